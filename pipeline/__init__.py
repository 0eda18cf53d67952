"""mxspec: quantize a target to MXFP4 with AMD Quark, pair it with its unchanged DFlash drafter,
validate that acceptance did not drift, gate the result and publish it."""

__version__ = "0.1.0"
