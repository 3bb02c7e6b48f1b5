"""The `researcher` command (main) and its code sub-commands (code). Sits above everything; nothing imports it."""
