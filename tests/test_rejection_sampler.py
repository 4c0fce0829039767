"""The speculative-decoding rejection sampler: greedy exactness, losslessness, seeds."""

from __future__ import annotations

import zlib

import pytest

torch = pytest.importorskip("torch")

from atom_core.runner.sampler import Sampler, SamplingMetadata, processed_probs, seed_for_step  # noqa: E402
from atom_spec import rejection  # noqa: E402
from atom_spec.rejection import RejectionSampler  # noqa: E402

V = 6  # toy vocabulary
K = 3  # drafts per step
NEED = K + 1  # tokens generated per request: enough for every position of a step to matter
TMAX = NEED + K  # positions the toy target is defined for


def meta(n: int, **kw) -> SamplingMetadata:
    base = dict(temperatures=[1.0] * n, top_ks=[-1] * n, top_ps=[1.0] * n, seeds=[None] * n, steps=[0] * n)
    base.update({k: (v if isinstance(v, list) else [v] * n) for k, v in kw.items()})
    return SamplingMetadata(**base)


# -- greedy -------------------------------------------------------------------------------


def rows(*argmaxes: int, vocab: int = 8) -> torch.Tensor:
    """Logits whose row r has its maximum at argmaxes[r] (and a distractor elsewhere)."""
    out = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(len(argmaxes)))
    for r, a in enumerate(argmaxes):
        out[r, a] = 10.0
        out[r, (a + 1) % vocab] = 9.0
    return out


def test_greedy_accepts_every_matching_draft_and_adds_the_bonus_token():
    out = RejectionSampler()(rows(3, 5, 1, 7), [[3, 5, 1]], [None], meta(1, temperatures=0.0))
    assert out == [[3, 5, 1, 7]]


def test_greedy_stops_at_the_first_mismatch_with_the_targets_argmax():
    # The third draft would match, but it follows a rejected one.
    out = RejectionSampler()(rows(3, 5, 1, 7), [[3, 4, 1]], [None], meta(1, temperatures=0.0))
    assert out == [[3, 5]]
    out = RejectionSampler()(rows(3, 5, 1, 7), [[2, 5, 1]], [None], meta(1, temperatures=0.0))
    assert out == [[3]]


def test_greedy_with_no_drafts_is_the_argmax():
    out = RejectionSampler()(rows(6), [[]], [None], meta(1, temperatures=0.0))
    assert out == [[6]]


def test_greedy_batch_of_mixed_draft_counts_and_top_k_1():
    logits = rows(3, 5, 1, 7, 2, 4, 0, 3, 6, 6, 1, 5, 5, 2)
    drafts = [[3, 5, 1], [], [4, 1], [6, 6, 0, 5], []]
    # request 0: all 3 accepted + bonus 7; 1: no drafts -> 2; 2: 4 ok, 1 != 0 -> 0;
    # 3: 6, 6 ok, 0 != 1 -> 1; 4: none -> 2.
    m = meta(5, temperatures=[0.0, 0.0, 1.3, 0.0, 0.0], top_ks=[-1, -1, 1, -1, -1])
    out = RejectionSampler()(logits, drafts, [None, None, torch.full((2, 8), 1 / 8), None, None], m)
    assert out == [[3, 5, 1, 7], [2], [4, 0], [6, 6, 1], [2]]


def test_greedy_speculation_reproduces_greedy_decoding_token_for_token():
    """Random drafts that sometimes match, on a target that depends on the previous token."""
    g = torch.Generator().manual_seed(3)
    table = torch.randn(40, 12, 12, generator=g)  # logits[position, previous token]
    plain = [0]
    for t in range(30):
        plain.append(int(table[t, plain[-1]].argmax()))
    spec, sampler = [0], RejectionSampler()
    while len(spec) < 31:
        t = len(spec) - 1
        n = int(torch.randint(0, 4, (), generator=g))
        drafts, prev = [], spec[-1]
        for j in range(n):  # a draft that is right 70% of the time
            good = int(table[t + j, prev].argmax())
            prev = good if torch.rand((), generator=g) < 0.7 else int(torch.randint(0, 12, (), generator=g))
            drafts.append(prev)
        ctx = [spec[-1], *drafts]
        logits = torch.stack([table[t + j, ctx[j]] for j in range(n + 1)])
        spec += sampler(logits, [drafts], [None], meta(1, temperatures=0.0, steps=t))[0]
    assert spec[:31] == plain


# -- losslessness ---------------------------------------------------------------------------


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The shaped target, written out independently of atom_core.runner.sampler, in float64."""
    z = logits.double() / temperature
    if 0 < top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    p = z.softmax(dim=-1)
    if top_p < 1:
        flat = p.reshape(-1, p.shape[-1])
        for row in flat:
            mass = 0.0  # keep the most likely tokens until their mass reaches top_p
            for tok in row.argsort(descending=True).tolist():
                if mass >= top_p:
                    row[tok] = 0.0
                else:
                    mass += float(row[tok])
        p = flat.reshape(p.shape)
        p = p / p.sum(dim=-1, keepdim=True)
    return p


SHAPINGS = {
    "plain": (1.0, -1, 1.0),
    "cold": (0.6, -1, 1.0),
    "hot-top-k": (1.5, 3, 1.0),
    "top-p": (1.0, -1, 0.75),
    "all-three": (0.8, 4, 0.85),
}


def toy_target(shaping: str):
    """A Markov target: logits[t, prev] scores the token at position t after token prev."""
    logits = 1.5 * torch.randn(TMAX, V, V, generator=torch.Generator().manual_seed(11))
    return logits, reference_probs(logits, *SHAPINGS[shaping])


def draft_table(kind: str, logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The distribution drafts are drawn from, per (position, previous token)."""
    if kind == "exact":
        return p.float()
    if kind == "wrong":  # anti-correlated with the target, mostly off its support
        return (-3.0 * logits).softmax(dim=-1)
    # Partly right: the target's logits, perturbed.
    return (logits + 1.5 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(12))).softmax(dim=-1)


def speculate(sampler, toy, q_kind: str, t: torch.Tensor, prev: torch.Tensor, g, seeds=None):
    """One verification step for requests at positions t whose last token is prev.

    q_kind: "exact" | "wrong" | "partial" (drafts drawn from that q, q passed along),
    "onehot-random" (drafts from the partial q, draft_probs None), or "onehot-fixed"
    (drafts always the target's least likely token, draft_probs None). Each request
    gets 0..K drafts at random.
    """
    shaping, logits_table, q_table = toy
    m = len(t)
    ctx = [prev]
    for j in range(K):
        if q_kind == "onehot-fixed":
            ctx.append(logits_table[t + j, ctx[-1]].argmin(dim=-1))
        else:
            ctx.append(torch.multinomial(q_table[t + j, ctx[-1]], 1, generator=g).squeeze(1))
    ctx = torch.stack(ctx, dim=1)  # [m, K + 1]: the previous token, then the drafts
    pos = t[:, None] + torch.arange(K + 1)
    num = torch.multinomial(torch.tensor([0.15, 0.15, 0.2, 0.5]), m, replacement=True, generator=g)
    keep = torch.arange(K + 1)[None, :] <= num[:, None]
    nums = num.tolist()
    drafts = [c[1 : 1 + k] for c, k in zip(ctx.tolist(), nums)]
    if q_kind.startswith("onehot"):
        probs = [None] * m
    else:
        probs = list(q_table[pos[:, :K], ctx[:, :K]][keep[:, 1:]].split(nums))
    temp, top_k, top_p = SHAPINGS[shaping]
    md = meta(m, temperatures=temp, top_ks=top_k, top_ps=top_p, steps=t.tolist(), seeds=seeds)
    out = sampler(logits_table[pos, ctx][keep], drafts, probs, md)
    for o, d in zip(out, drafts):  # accepted drafts, then one token
        assert 1 <= len(o) <= len(d) + 1 and o[:-1] == d[: len(o) - 1]
    return out


def problem(shaping: str, q_kind: str):
    """(shaping, target logits table, draft table) and the target's exact conditionals."""
    logits_table, p = toy_target(shaping)
    q_table = draft_table("partial" if q_kind.startswith("onehot") else q_kind, logits_table, p)
    return (shaping, logits_table, q_table), p


def one_step(sampler, shaping: str, q_kind: str, n: int):
    """n requests verifying their first drafts after token 0; returns their tokens and p."""
    toy, p = problem(shaping, q_kind)
    zeros = torch.zeros(n, dtype=torch.long)
    g = torch.Generator().manual_seed(zlib.crc32(f"{shaping}/{q_kind}".encode()))  # cases draw apart
    return speculate(sampler, toy, q_kind, zeros, zeros, g), p


def simulate(sampler, shaping: str, q_kind: str, n: int, seeded: bool = False):
    """Generate NEED tokens for each of n requests, step after step; returns [n, NEED]."""
    toy, p = problem(shaping, q_kind)
    g = torch.Generator().manual_seed(5)
    out = [[] for _ in range(n)]
    while active := [r for r in range(n) if len(out[r]) < NEED]:
        t = torch.tensor([len(out[r]) for r in active])
        prev = torch.tensor([out[r][-1] if out[r] else 0 for r in active])
        seeds = [1000 + r for r in active] if seeded else None
        for r, toks in zip(active, speculate(sampler, toy, q_kind, t, prev, g, seeds)):
            out[r] += toks
    return torch.tensor([o[:NEED] for o in out]), p


def chi_square_p_value(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probabilities, row by row (each row of `probs`
    sums to 1; the statistics and degrees of freedom add up). Cells expecting fewer than
    5 draws are pooled; a draw the target gives probability 0 fails outright."""
    observed, probs = observed.double().reshape(-1, probs.shape[-1]), probs.double().reshape(-1, probs.shape[-1])
    if observed[probs == 0].sum() > 0:
        return 0.0
    stat, df = 0.0, 0
    for obs, pr in zip(observed, probs):
        exp = pr * obs.sum()
        small = exp < 5
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
        obs, exp = obs[exp > 0], exp[exp > 0]
        stat += float(((obs - exp) ** 2 / exp).sum())
        df += max(len(exp) - 1, 0)
    if df == 0:
        return 1.0
    return float(1 - torch.distributions.Chi2(torch.tensor(float(df))).cdf(torch.tensor(stat)))


def position_p_values(out: list[list[int]], p: torch.Tensor) -> list[float]:
    """One step from token 0: the token at position j, given the (accepted) token before
    it, against the target's conditional p[j, previous]. Position 0 has every request."""
    values = []
    for j in range(K + 1):
        reached = [o for o in out if len(o) > j]
        prev = torch.tensor([o[j - 1] if j else 0 for o in reached], dtype=torch.long)
        tok = torch.tensor([o[j] for o in reached], dtype=torch.long)
        counts = torch.bincount(prev * V + tok, minlength=V * V).reshape(V, V)
        values.append(chi_square_p_value(counts, p[j]))
    return values


def pair_p_values(tokens: torch.Tensor, p: torch.Tensor) -> list[float]:
    """Many steps: for each t, the joint of (token t, token t + 1) against the target's."""
    marginal = p[0, 0]  # the first token follows token 0
    values = []
    for t in range(NEED - 1):
        joint = marginal[:, None] * p[t + 1]
        counts = torch.bincount(tokens[:, t] * V + tokens[:, t + 1], minlength=V * V)
        values.append(chi_square_p_value(counts, joint.flatten()))
        marginal = joint.sum(dim=0)
    return values


ALPHA = 1e-4  # per p-value; about 60 of them, so a false alarm once in ~170 seedings
DRAWS = 12000  # per case

CASES = [
    ("plain", "exact"),
    ("plain", "wrong"),
    ("plain", "partial"),
    ("plain", "onehot-random"),
    ("cold", "partial"),
    ("cold", "onehot-fixed"),
    ("hot-top-k", "wrong"),
    ("hot-top-k", "partial"),
    ("top-p", "exact"),
    ("top-p", "partial"),
    ("all-three", "partial"),
    ("all-three", "onehot-fixed"),
]


@pytest.mark.parametrize("shaping,q_kind", CASES)
def test_each_emitted_token_follows_the_targets_conditional(shaping, q_kind):
    out, p = one_step(RejectionSampler(), shaping, q_kind, DRAWS)
    p_values = position_p_values(out, p)
    assert min(p_values) > ALPHA, p_values


@pytest.mark.parametrize("shaping,q_kind,seeded", [("all-three", "partial", False), ("plain", "partial", True)])
def test_step_after_step_the_sequences_follow_the_target(shaping, q_kind, seeded):
    tokens, p = simulate(RejectionSampler(), shaping, q_kind, 6000, seeded=seeded)
    p_values = pair_p_values(tokens, p)
    assert min(p_values) > ALPHA, p_values


def test_drafts_from_the_target_itself_are_all_accepted_and_impossible_ones_never():
    """Acceptance is min(1, p(d) / q(d)) with q as given: 1 when q is p, 0 off p's support.
    (A sampler that ignored q would still be lossless, but would waste these drafts.)"""
    g = torch.Generator().manual_seed(4)
    logits = 2 * torch.randn(50 * 4, 30, generator=g)  # 50 requests, 3 drafts each
    shaping = dict(temperatures=0.7, top_ks=10, top_ps=0.9)
    p = processed_probs(logits, [0.7] * 200, [10] * 200, [0.9] * 200)
    p = (p / p.sum(dim=-1, keepdim=True)).view(50, 4, 30)
    drafts = [torch.multinomial(p[r, :3], 1, generator=g).squeeze(1).tolist() for r in range(50)]
    out = RejectionSampler()(logits, drafts, [p[r, :3] for r in range(50)], meta(50, **shaping))
    assert [o[:3] for o in out] == drafts and all(len(o) == 4 for o in out)
    outside = [(p[r, 0] == 0).nonzero()[:3, 0].tolist() for r in range(50)]
    out = RejectionSampler()(logits, outside, [None] * 50, meta(50, **shaping))
    assert all(len(o) == 1 and p[r, 0, o[0]] > 0 for r, o in enumerate(out))


class AlwaysAccepts(RejectionSampler):
    """Broken on purpose: keeps every draft of a sampled request."""

    def _accept_sampled(self, logits, drafts, *args):
        rows, _, p = super()._accept_sampled(logits, drafts, *args)
        return rows, drafts[rows] >= 0, p


@pytest.mark.parametrize("shaping,q_kind", [("plain", "partial"), ("hot-top-k", "onehot-random")])
def test_the_check_catches_a_sampler_that_accepts_every_draft(shaping, q_kind):
    out, p = one_step(AlwaysAccepts(), shaping, q_kind, DRAWS)
    assert min(position_p_values(out, p)) < 1e-9


def test_the_many_step_check_catches_it_too():
    tokens, p = simulate(AlwaysAccepts(), "plain", "partial", 6000)
    assert min(pair_p_values(tokens, p)) < 1e-9


@pytest.mark.parametrize("shaping,q_kind", [("plain", "partial"), ("top-p", "partial")])
def test_the_check_catches_resampling_from_p_instead_of_the_residual(shaping, q_kind, monkeypatch):
    """The classic bug: after a rejection, drawing from p rather than max(p - q, 0)."""
    monkeypatch.setattr(rejection, "_residual", lambda p, q: p)
    out, p = one_step(RejectionSampler(), shaping, q_kind, DRAWS)
    assert min(position_p_values(out, p)) < 1e-9


# -- seeds ------------------------------------------------------------------------------------


def seeded_case(seed: int):
    """One sampled, seeded request with 3 drafts and a draft distribution."""
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(4, 50, generator=g)
    q = (logits[:3] + torch.randn(3, 50, generator=g)).softmax(dim=-1)  # roughly the target
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1).tolist()
    return logits, drafts, q


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(0)
    filler_logits = torch.randn(3 + 1 + 4, 50, generator=g)
    filler_drafts = [[1, 2], [], [3, 4, 5]]
    filler_q = [(torch.randn(2, 50, generator=g)).softmax(-1), None, None]
    lengths = set()
    for seed in range(40):
        logits, drafts, q = seeded_case(seed)
        settings = dict(temperatures=0.9, top_ks=20, top_ps=0.9, seeds=seed, steps=7)
        alone = RejectionSampler()(logits, [drafts], [q], meta(1, **settings))[0]
        for place in (0, 3):  # first or last in the batch
            all_logits = [filler_logits[:3], filler_logits[3:4], filler_logits[4:]]
            all_logits.insert(place, logits)
            batch_drafts = filler_drafts[:place] + [drafts] + filler_drafts[place:]
            batch_q = filler_q[:place] + [q] + filler_q[place:]
            others = dict(
                temperatures=[1.0, 0.0, 0.7],
                top_ks=[-1, -1, 5],
                top_ps=[1.0, 1.0, 0.8],
                seeds=[None, None, 123],
                steps=[0, 4, 9],
            )
            batch_meta = meta(4, **{k: v[:place] + [settings[k]] + v[place:] for k, v in others.items()})
            # A different global seed too: the seeded request must not depend on it.
            sampler = RejectionSampler(type("Cfg", (), {"seed": 99, "device": "cpu"})())
            batched = sampler(torch.cat(all_logits), batch_drafts, batch_q, batch_meta)
            assert batched[place] == alone
        lengths.add(len(alone))
    # Rejections at every position and full acceptance both happened: every path was compared.
    assert lengths == {1, 2, 3, 4}


def test_a_seeded_request_depends_on_its_step():
    logits, drafts, q = seeded_case(1)
    outs = {
        tuple(RejectionSampler()(logits, [drafts], [q], meta(1, seeds=5, steps=s, temperatures=1.5))[0])
        for s in range(20)
    }
    assert len(outs) > 3


def test_a_seeded_position_draws_its_uniform_then_its_noise_from_the_token_index_stream():
    """The documented layout, worked by hand: position j of a request at step s uses a
    generator seeded with seed_for_step(seed, s + j), first the acceptance uniform (draft positions
    only), then the race's noise, so the two are never the same numbers."""
    V, seen = 20, set()
    for seed in range(30):
        g = torch.Generator().manual_seed(seed)
        logits = 2 * torch.randn(2, V, generator=g)
        d = int(logits[0].argmax()) if seed % 2 else int(torch.randint(0, V, (), generator=g))
        out = RejectionSampler()(logits, [[d]], [None], meta(1, seeds=seed, steps=5))[0]
        p = logits.softmax(dim=-1)
        row = torch.Generator().manual_seed(seed_for_step(seed, 5))
        u = torch.rand((), generator=row)
        if u < p[0, d]:  # accepted; the bonus position has no uniform
            row.manual_seed(seed_for_step(seed, 6))
            expected = [d, int((p[1] / torch.empty(V).exponential_(generator=row)).argmax())]
        else:
            residual = p[0].clone()
            residual[d] = 0
            expected = [int((residual / torch.empty(V).exponential_(generator=row)).argmax())]
        assert out == expected
        seen.add(len(out))
    assert seen == {1, 2}


def test_with_no_drafts_a_seeded_request_gets_the_plain_samplers_token():
    logits = torch.randn(200, 1000, generator=torch.Generator().manual_seed(2))
    settings = dict(temperatures=0.8, top_ks=50, top_ps=0.95, seeds=list(range(200)), steps=list(range(200)))
    plain = Sampler()(logits, meta(200, **settings)).tolist()
    spec = RejectionSampler()(logits, [[] for _ in range(200)], [None] * 200, meta(200, **settings))
    assert [s[0] for s in spec] == plain


# -- input errors -------------------------------------------------------------------------------


def test_inputs_of_the_wrong_shape_are_refused():
    sampler = RejectionSampler()
    with pytest.raises(ValueError, match=r"logits must be \[sum of \(drafts \+ 1\), vocab\] = \[3, vocab\]"):
        sampler(torch.zeros(2, 8), [[1, 2]], [None], meta(1))
    with pytest.raises(ValueError, match=r"draft_probs\[0\] must be \[1, 8\]"):
        sampler(torch.zeros(2, 8), [[1]], [torch.zeros(2, 8)], meta(1))
    with pytest.raises(ValueError, match=r"draft token ids must be in \[0, 8\)"):
        sampler(torch.zeros(2, 8), [[8]], [None], meta(1))
    with pytest.raises(ValueError, match="1 requests of drafts, but 2 draft_probs"):
        sampler(torch.zeros(2, 8), [[1]], [None, None], meta(1))
