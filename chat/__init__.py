"""Conversations: the one chat template (template.py) and the SFT/DPO preparation command (prepare.py)."""
