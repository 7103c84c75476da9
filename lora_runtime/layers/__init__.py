"""Building blocks of the model: normalisation, rotary embeddings, attention over the paged cache."""
