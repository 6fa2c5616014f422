"""Protocol limits shared by the gateway (request validation) and the engines (step checks)."""

from __future__ import annotations

MAX_CHAIN_K = 16        # draft tokens of a chain a request may ask for
# An overlap pre-draft is one token longer: it also guesses the bonus token of the draft in flight.
MAX_DRAFTED_CHAIN = MAX_CHAIN_K + 1
MAX_TREE_TOPK = 8
MAX_TREE_DEPTH = 10
MAX_TREE_BUDGET = 64
