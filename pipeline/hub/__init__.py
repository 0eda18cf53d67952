"""How mxspec reaches the Hugging Face Hub: the offline switch and endpoint."""
