"""Which replica runs a prompt: the one most likely to hold its prefix in cache (the last one that served the
same first blocks of a prompt) unless that one is much busier than the least busy; a prompt never seen goes to
the least busy."""

from __future__ import annotations

from collections import OrderedDict

PREFIX_BLOCKS = 4  # the first blocks of a prompt that name its prefix for routing
MAX_REMEMBERED = 65536  # prefixes the router remembers (least recently routed forgotten first)


class Router:
    """Picks the replica for a prompt: the one that last served its first blocks, unless it is much busier than
    the least busy (more than `ratio` times its requests in flight plus `slack`); else the least busy (equals
    taken in turn)."""

    def __init__(self, block_size: int, slack: int = 2, ratio: float = 1.5) -> None:
        self.block_size, self.slack, self.ratio = block_size, slack, ratio
        self._last: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica
        self._turn = 0  # where the search for the least busy starts: equals take turns

    def pick(self, prompt_token_ids: list[int], loads: list[int]) -> int:
        """The replica for a prompt among len(loads) (the count may change between calls: a prefix last served
        by a replica since removed counts as unseen)."""
        keys = self._prefix_keys(prompt_token_ids)
        count = len(loads)
        order = [(self._turn + i) % count for i in range(count)]
        least = min(order, key=lambda i: loads[i])
        choice = least
        for key in reversed(keys):  # the longest prefix seen before
            holder = self._last.get(key)
            if holder is not None and holder < count:
                if loads[holder] <= loads[least] * self.ratio + self.slack:
                    choice = holder
                break
        if choice == least:
            self._turn = (least + 1) % count
        for key in keys:
            self._last[key] = choice
            self._last.move_to_end(key)
        while len(self._last) > MAX_REMEMBERED:
            self._last.popitem(last=False)
        return choice

    def _prefix_keys(self, tokens: list[int]) -> list[int]:
        """Chained hashes of the prompt's first full blocks (at least one key, for prompts under a block)."""
        size = self.block_size
        num_blocks = min(len(tokens) // size, PREFIX_BLOCKS)
        if num_blocks == 0:
            return [hash(tuple(tokens))]
        keys, key = [], 0
        for b in range(num_blocks):
            key = hash((key, tuple(tokens[b * size:(b + 1) * size])))
            keys.append(key)
        return keys
