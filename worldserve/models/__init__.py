"""worldserve.models: see design.md §3.2 for this stage's role in the data flow."""
