"""Building blocks of the model: the rotary tables (the projections are `kernels.linear`)."""
