"""Data files shipped with worldserve (the default negative prompt)."""
