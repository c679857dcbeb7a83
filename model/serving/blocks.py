"""The books of a pool of KV blocks (model/serving/paged.py holds the tensors): who reads each block, which hold a
named prefix, and which go first when the pool runs out. No tensors here, as nano-vllm's block manager has none.

A block holds `block_tokens` tokens' keys and values. Blocks are counted by reference. A full block is also named
by a hash of every token up to its end (a chain: the block's tokens and the hash before it), so that a later
sequence that starts with the same tokens reads it instead of computing it again (a prefix cache). A full block
is never written again, so sharing it is safe. When its last reader leaves, it stays cached until the pool needs
it, the least recently used first.
"""

import hashlib
from collections import OrderedDict


def chain_hash(parent: bytes, tokens) -> bytes:
    """The name of a full block: sha256 of the hash before it and its tokens."""
    return hashlib.sha256(parent + b"".join(int(t).to_bytes(4, "little") for t in tokens)).digest()


def full_block_names(tokens: list[int], bt: int, known: list[bytes] = ()) -> list[bytes]:
    """The chain hash of each full block of tokens; known: those of its first blocks, already computed."""
    names = list(known)
    for start in range(len(names) * bt, len(tokens) - bt + 1, bt):
        names.append(chain_hash(names[-1] if names else b"", tokens[start:start + bt]))
    return names


class BlockBooks:
    """The books of n_blocks blocks of block_tokens slots: references, names, and the free and the idle."""

    def __init__(self, n_blocks: int, block_tokens: int):
        self.n_blocks, self.block_tokens = n_blocks, block_tokens
        self.refs = [0] * n_blocks
        self.free = list(range(n_blocks - 1, -1, -1))  # never named, or named no longer
        self.idle: OrderedDict[int, None] = OrderedDict()  # named blocks nobody reads, least recently used first
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.touched: set[int] = set()  # blocks whose books changed since BlockPictures last took them (census.py)

    def available(self) -> int:
        """Blocks that allocate() can hand out now."""
        return len(self.free) + len(self.idle)

    def allocate(self) -> int | None:
        """A block for one reader, or None when every block is read."""
        if self.free:
            block = self.free.pop()
        elif self.idle:
            block, _ = self.idle.popitem(last=False)  # the least recently used cached prefix goes
            del self.by_hash[self.hash_of.pop(block)]
        else:
            return None
        self.refs[block] = 1
        self.touched.add(block)
        return block

    def lookup(self, name: bytes) -> int | None:
        """The cached block with this name, now read by one more, or None."""
        block = self.by_hash.get(name)
        if block is not None:
            self.idle.pop(block, None)
            self.refs[block] += 1
            self.touched.add(block)
        return block

    def name(self, block: int, name: bytes) -> None:
        """Register a block that has just become full under its chain hash (unless a block already holds it)."""
        if name not in self.by_hash and block not in self.hash_of:
            self.by_hash[name], self.hash_of[block] = block, name
            self.touched.add(block)

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        self.touched.add(block)
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.idle[block] = None  # the most recently used end
            else:
                self.free.append(block)
