"""MXFP4 quantization: the format as an executable spec, what stays unquantized, calibration text,
the memory arithmetic that picks a mode, and the file-to-file writer that feeds Quark shard by shard."""
