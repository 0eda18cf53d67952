"""The validation study: its cells (one server or one reference pass each), how they are planned and
executed (locally or on Ray), the workloads and answers, and the measures (acceptance drift, fidelity)
taken by the served (vLLM) and reference backends."""
