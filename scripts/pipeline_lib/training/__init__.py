"""train_draft.py's parts, one module per concern."""
