"""Building blocks of the model: the linear projection and the rotary tables."""
