"""What an agent episode leaves behind: one ``CallRecord`` per ``/v1/chat/completions`` (or
``/v1/completions``) request it made through the trainer's endpoint, and the trajectories made of them.

A ``CallRecord`` holds the prompt ids exactly as the engine was given them, the ids it sampled, their
log-probs, the policy version that sampled each token, the MoE expert ids (when asked for), the
sampling parameters the engine ran with and the ones the request asked for.

``episode_trees(calls, rewards, group, task)`` lays an episode's calls out as rollout trees, never
re-tokenising text: calls are inserted one after another into a prefix tree of token segments. A
call's prompt is matched against the tree from a root, token for token, through environment segments
(prompt and tool/user tokens: loss mask 0) and model segments (earlier completions: mask 1); where it
stops matching, the rest of the prompt becomes a new environment segment (a node is split at the
point where the prompt leaves it), and the call's completion a new model segment under it. So

- a call whose prompt extends the previous call's prompt + completion token for token continues that
  trajectory (one multi-turn sample: tool and user tokens masked, model tokens trained);
- a call that rewrote the history shares only the common prefix (a tree: both leaves train it once);
- a call that shares no token with an earlier root starts a new tree (a separate sample).

Every leaf is a completion; its reward is the per-call reward of that call when one was given, else
the episode's. Invariant: each trajectory's tokens are the prompt ids of its last call followed by that
call's sampled ids, and its loss mask is 1 exactly on tokens some call sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from arbor.rollout.tree import Node, RolloutTree, Segment


@dataclass
class CallRecord:
    """One request of an episode as the engine served it (module docstring)."""
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed_experts: object = None          # torch.Tensor [moe layers, len(token_ids), k] or None
    params: dict = field(default_factory=dict)        # what the engine sampled with
    requested: dict = field(default_factory=dict)     # what the request asked for
    finish_reason: str | None = None
    text: str = ""
    id: str = ""                           # the call's index in its episode (per-call rewards are keyed by it)
    chat: bool = True
    messages: list | None = None           # the normalized request messages (chat)
    reply: dict | None = None              # the normalized assistant message returned (chat)
    tools_key: str = ""                    # the request's tools, canonical JSON ("" for none)
    plan: object = None                    # the request's ``arbor.serve.tool_calling.ToolPlan`` (chat)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def _split(node: Node, at: int) -> None:
    """Cut ``node``'s segment after ``at`` tokens: the rest (and the children) move to a new child."""
    s = node.segment
    if 0 < at < len(s.tokens):
        routed = s.routed_experts
        tail = Segment(s.tokens[at:], s.is_model, s.logprobs[at:], s.versions[at:],
                       None if routed is None else routed[:, at:])
        rest = Node(tail, node.children, node.reward, node.text)
        node.segment = Segment(s.tokens[:at], s.is_model, s.logprobs[:at], s.versions[:at],
                               None if routed is None else routed[:, :at])
        node.children, node.reward, node.text = [rest], None, ""


def _common(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of ``a`` and ``b[start:]``."""
    n = 0
    for x, y in zip(a, b[start:]):
        if x != y:
            break
        n += 1
    return n


def _insert(roots: list[Node], call: CallRecord) -> Node:
    """Place ``call`` in the forest ``roots`` (module docstring) → the leaf of its completion."""
    prompt = call.prompt_ids
    node = max(roots, key=lambda r: _common(r.segment.tokens, prompt, 0), default=None)
    if node is None or _common(node.segment.tokens, prompt, 0) == 0:
        node = Node(Segment(list(prompt), is_model=False))
        roots.append(node)
        pos = len(prompt)
    else:
        pos = 0
        while True:
            n = _common(node.segment.tokens, prompt, pos)
            if n < len(node.segment.tokens):
                _split(node, n)
                pos += n
                break
            pos += n
            nxt = next((c for c in node.children if pos < len(prompt) and c.segment.tokens[:1] == [prompt[pos]]),
                       None)
            if nxt is None:
                break
            node = nxt
        if pos < len(prompt):
            env = Node(Segment(prompt[pos:], is_model=False))
            node.children.append(env)
            node = env
    leaf = Node(Segment(list(call.token_ids), True, list(call.logprobs), list(call.versions), call.routed_experts),
                text=call.text)
    node.children.append(leaf)
    return leaf


class EpisodeTrees:
    """The trees of one group's episodes, seen by the trainer as one group (``trajectories()`` in
    tree order; every trajectory carries ``group``)."""

    def __init__(self, trees: list[RolloutTree], group: int, task=None):
        self.trees, self.group, self.task = trees, group, task

    def trajectories(self):
        return [t for tree in self.trees for t in tree.trajectories()]

    def num_tokens(self) -> tuple[int, int]:
        sums = [tree.num_tokens() for tree in self.trees]
        return sum(s[0] for s in sums), sum(s[1] for s in sums)


def episode_trees(calls: list[CallRecord], reward: float, call_rewards: dict[str, float], group: int,
                  task=None) -> list[RolloutTree]:
    """An episode's finished calls (in the order they were made) → its rollout trees (module docstring).
    ``call_rewards``: response id → that call's reward (overrides ``reward`` on its leaf)."""
    roots: list[Node] = []
    for call in calls:
        if not call.token_ids:             # nothing sampled (max_tokens reached at once): nothing to train
            continue
        leaf = _insert(roots, call)
        leaf.reward = float(call_rewards.get(call.id, reward))
    trees = [RolloutTree(root, group, task) for root in roots]
    for tree in trees:                     # an extended completion is no leaf; a root must hold a prompt
        _check_leaves(tree.root)
    return trees


def _check_leaves(node: Node) -> None:
    for c in node.children:
        _check_leaves(c)
    if not node.children and not node.segment.is_model:
        raise AssertionError("an agent trajectory ends on environment tokens")      # _insert never builds one
    if node.children and node.reward is not None and node.segment.is_model:
        node.reward = None
