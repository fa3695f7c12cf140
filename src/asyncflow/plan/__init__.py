"""Planning: a simulator of the workflows on measured or spec-derived costs (`asyncflow profile` / `plan`)."""
