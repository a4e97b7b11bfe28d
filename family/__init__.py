"""The family's data: memories, feedback and consent, accounts (SQLite, no torch)."""
