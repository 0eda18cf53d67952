"""The pipeline's stages, one module each: preflight (checks before anything runs), resolve, quantize,
pair, validate, gate and publish. Each is thin: it reads its inputs, calls the job's library
(`quant`, `study`, `report`, `hub`) and writes its typed artifacts through `run.runner`."""
