"""Tools: the registry and bounded loop, constrained calls, and the tool-use data generator."""
