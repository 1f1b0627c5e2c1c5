"""The process a run lives in, set up before or around JAX: the XLA flags set before JAX
starts, `jax.distributed` from the environment, a local multi-process launcher, and the
command-line conventions the shells share."""
