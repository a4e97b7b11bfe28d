"""Conversations: the one chat template and the SFT/DPO preparation command."""
