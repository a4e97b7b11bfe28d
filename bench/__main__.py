"""
Benchmarks: `python -m bench [SECTION ...]` (`make bench`) runs the named sections, or all of them.
Each section is a top-level bench_<name>() in a bench_*.py file that prints its figures; timing lives
there, never in tests.
"""

import sys

from bench import agent as bench_agent
from bench import data as bench_data
from bench import decoding
from bench import evaluation as bench_evaluation
from bench import llama_cpp as bench_llama_cpp
from bench import model as bench_model
from bench import peak as bench_peak
from bench import security as bench_security
from bench import serve as bench_serve

SECTIONS = {
    "model": bench_model.bench_model,
    "decode": bench_model.bench_decode,
    "data": bench_data.bench_data,
    "corpus": bench_data.bench_corpus,
    "search": bench_serve.bench_search,
    "serve": bench_serve.bench_serve,
    "bandwidth": decoding.bench_decoding,
    "llama": bench_llama_cpp.bench_llama,
    "memory": bench_serve.bench_memory,
    "eval": bench_evaluation.bench_eval,
    "agent": bench_agent.bench_agent,
    "answers": bench_agent.bench_answers,
    "security": bench_security.bench_security,
    "peak": bench_peak.bench_peak,
}


def main(argv):
    names = argv or list(SECTIONS)
    unknown = [name for name in names if name not in SECTIONS]
    if unknown:
        print(f"unknown bench section(s) {unknown}; sections: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    for name in names:
        SECTIONS[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
