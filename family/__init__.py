"""The family's data: memories, feedback and consent, accounts and their `member` command (SQLite, no torch)."""
