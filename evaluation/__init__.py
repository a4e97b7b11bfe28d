"""Evaluation: ENLACE inside lm-evaluation-harness, report cards, the tool-use rates, plots."""
