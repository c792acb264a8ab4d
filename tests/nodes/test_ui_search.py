"""How ComfyUI 0.29's node search (frontend 1.47.10: src/services/nodeSearchService.ts and
src/utils/fuseUtil.ts) treats our nodes. Fuse.js admits a node when the query matches its class
id, display name or one of its search aliases; the results are then ordered by
[main, -usage, aux1, aux2, fuse score + length penalty], where `main` comes from the class id and
display name alone (an alias-only match gets 9, the worst). So an alias lets the right node into
the results; only a title holding the word ranks it high. Replayed here on our five nodes."""
import re

import pytest
from triton_accel import nodes as pack_nodes

# query -> the nodes a user searching it wants (each must be admitted by an alias or its title)
WANTED = {"sage": {"TritonAccelPatchAttention", "TritonAccelPatch"},
          "flash": {"TritonAccelPatchAttention", "TritonAccelPatch"},
          "attention": {"TritonAccelPatchAttention", "TritonAccelPatch", "TritonAccelSettings"},
          "fp8": {"TritonAccelPatchLinear", "TritonAccelPatch", "TritonAccelSettings"},
          "speed": {"TritonAccelPatchAttention", "TritonAccelPatchLinear", "TritonAccelPatch"},
          "triton": set(pack_nodes.NODE_CLASS_MAPPINGS)}


def aux_single(query: str, item: str) -> tuple:
    """fuseUtil.ts calcAuxSingle, without the Fuse score."""
    words = [w.lower() for w in re.split(r" |\b|(?<=[a-z])(?=[A-Z])|(?=[A-Z][a-z])", item) if w is not None]
    item = item.lower()
    if item == query:
        return (0, 0, 0)
    if item.startswith(query):
        return (1, 0, len(item))
    if query in words:
        return (2, item.index(query) + len(item) * 0.5, len(item))
    if query in item:
        return (3, item.index(query) + len(item) * 0.5, len(item))
    return (9, 0, 0)


def rank_key(query: str, node_id: str) -> tuple:
    title = pack_nodes.NODE_DISPLAY_NAME_MAPPINGS[node_id]
    penalty = lambda item: 0.2 * (1 - min(len(item), len(query)) / max(len(item), len(query)))  # noqa: E731
    return min(aux_single(query, item) + (penalty(item),) for item in (node_id, title))


def admitted(query: str, node_id: str) -> bool:
    node = pack_nodes.NODE_CLASS_MAPPINGS[node_id]
    title = pack_nodes.NODE_DISPLAY_NAME_MAPPINGS[node_id]
    return query in [a.lower() for a in node.SEARCH_ALIASES] or query in title.lower() or query in node_id.lower()


def test_aliases_are_lists_of_strings():
    # The frontend's schema is z.array(z.string()): a string here would drop the node definition.
    for node_id, node in pack_nodes.NODE_CLASS_MAPPINGS.items():
        assert isinstance(node.SEARCH_ALIASES, list) and all(isinstance(a, str) for a in node.SEARCH_ALIASES), node_id


@pytest.mark.parametrize("query", list(WANTED))
def test_the_right_nodes_are_found(query):
    found = {node_id for node_id in pack_nodes.NODE_CLASS_MAPPINGS if admitted(query, node_id)}
    assert WANTED[query] <= found, (query, found)


@pytest.mark.parametrize("query", ["sage", "flash"])
def test_benchmark_stays_out_of_the_attention_searches(query):
    assert not admitted(query, "TritonAccelBenchmark")


@pytest.mark.parametrize("query", ["sage", "flash", "fp8", "speed", "triton"])
def test_among_ours_a_wanted_node_comes_first(query):
    ours = sorted((n for n in pack_nodes.NODE_CLASS_MAPPINGS if admitted(query, n)), key=lambda n: rank_key(query, n))
    assert ours[0] in WANTED[query], (query, ours)


def test_titles_are_the_ones_users_know():
    assert pack_nodes.NODE_DISPLAY_NAME_MAPPINGS == {
        "TritonAccelSettings": "Triton Accel Settings", "TritonAccelPatchAttention": "Triton Accel Attention",
        "TritonAccelPatchLinear": "Triton Accel Linear", "TritonAccelPatch": "Triton Accel Patch",
        "TritonAccelBenchmark": "Triton Accel Benchmark"}
