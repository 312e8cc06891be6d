"""
Decode steps shared between the clients whose rows one worker decodes (docs/serving.md, "Under hostile load"), an
add-on of nanochat/engine.py's BatchEngine: DecodeCost says what a step costs (measured when the worker starts,
refitted to the steps as they run), and FairShare, set as the engine's row_policy, picks the rows each step feeds:
the clients whose rows cost least at every step, the heavier ones' rows a row each in turn within what the step may
cost; and the prompts each step prefills: the clients in turn, within a share of what the others' steps cost. A row
that waits keeps its cache and writes exactly the tokens it would have written.
"""

import heapq
import time

import torch

from nanochat.engine import Sampling, Sequence

# A step shared between owners may cost at most this many times the light owners' rows alone (FairShare.pick): beside
# one heavy owner a light one keeps about four fifths of its step rate
FAIR_STRETCH = 1.25
# While other owners' rows decode with no prompt of theirs waiting, prompts are prefilled within this share of what
# their steps cost (FairShare.prefills): a chunk of 256 tokens took several decode steps' time, and a client
# prefilling long prompts in a loop left a neighbour 14-23 % of its pace
PREFILL_SHARE = 0.5
PREFILL_MIN_TOKENS = 128  # the smallest chunk worth its forward pass while prefills wait for credit


class DecodeCost:
    """
    What one decode step costs, in seconds: fixed + rows * (per_row + (per_row_key + gather_per_row_key if gathered)
    * extent), where extent is the key positions each row reads and gathered says the rows are not one run (RowView
    copies their keys out). measure_decode_cost times it at start; given the shapes it timed (`measured`), observe()
    then refits the four numbers by least squares to the steps as they run, recent ones weighing most, since a CPU's
    step costs what the rest of the machine and the rows' sampling let it, which a measurement at start cannot know.
    """

    FOLLOW_DECAY = 0.998  # a step's weight in the fit falls by this at each step after it: the last ~500 steps count
    PRIOR_STEPS = 20  # what the shapes measured at start weigh, in steps
    REFIT_EVERY = 32  # steps between two fits (each solves 4 equations)
    OUTLIER = 3.0  # a step timed at more than this many times its prediction counts as that much (the OS paused it)

    def __init__(self, fixed, per_row, per_row_key, gather_per_row_key=0.0, measured=(), prefill=None):
        """measured: [(rows, extent, gathered)] the shapes timed; none: the numbers stay as given. prefill: (fixed,
        per token, per token and key position) of a prompt's chunk, as measured (prefill_seconds); none: a token
        counted as a decoded row."""
        self.fixed, self.per_row, self.per_row_key, self.gather_per_row_key = \
            fixed, per_row, per_row_key, gather_per_row_key
        self.prefill = prefill or (fixed, per_row, per_row_key)
        self.follows = bool(measured)
        self.steps_seen = 0
        # normal equations of the fit: the steps seen (fading) and the measured shapes at their measured seconds
        self.xx, self.xy = [[0.0] * 4 for _ in range(4)], [0.0] * 4
        self.prior_xx, self.prior_xy = [[0.0] * 4 for _ in range(4)], [0.0] * 4
        for rows, extent, gathered in measured:
            x, y = self._features(rows, extent, gathered), self.seconds(rows, extent, gathered)
            self._accumulate(self.prior_xx, self.prior_xy, x, y, self.PRIOR_STEPS / len(measured))

    def seconds(self, rows, extent, gathered=False):
        per_key = self.per_row_key + (self.gather_per_row_key if gathered else 0.0)
        return self.fixed + rows * (self.per_row + per_key * extent)

    def prefill_seconds(self, tokens, extent):
        """What a forward prefilling `tokens` of one prompt up to position `extent` costs (a chunk's tokens go through
        the model together: several times cheaper each than a decoded row)."""
        fixed, per_token, per_token_key = self.prefill
        return fixed + tokens * (per_token + per_token_key * extent)

    def observe(self, rows, extent, gathered, seconds):
        """A step of that shape took `seconds`: fold it into the fit (refitted every REFIT_EVERY steps)."""
        if not self.follows:
            return
        seconds = min(seconds, self.OUTLIER * self.seconds(rows, extent, gathered))
        self._accumulate(self.xx, self.xy, self._features(rows, extent, gathered), seconds, 1.0, self.FOLLOW_DECAY)
        self.steps_seen += 1
        if self.steps_seen % self.REFIT_EVERY == 0:
            self._refit()

    def summary(self):
        fixed, per_token, per_token_key = self.prefill
        return (f"a decode step {1e3 * self.fixed:.2f} ms + {1e3 * self.per_row:.3f} ms a row + "
                f"{1e6 * self.per_row_key:.3f} ms a row per 1,000 positions (+{1e6 * self.gather_per_row_key:.3f} "
                f"gathered); a prompt's chunk {1e3 * fixed:.2f} ms + {1e3 * per_token:.3f} ms a token + "
                f"{1e6 * per_token_key:.3f} ms a token per 1,000 positions")

    @staticmethod
    def _features(rows, extent, gathered):
        keys = rows * extent / 1000  # in thousands: the four columns of the fit of comparable sizes
        return [1.0, float(rows), keys, keys if gathered else 0.0]

    @staticmethod
    def _accumulate(xx, xy, x, y, weight, decay=1.0):
        """Fade the normal equations by `decay`, then add a step x with seconds y."""
        for i in range(4):
            xy[i] = xy[i] * decay + weight * x[i] * y
            for j in range(4):
                xx[i][j] = xx[i][j] * decay + weight * x[i] * x[j]

    def _refit(self):
        a = torch.tensor([[p + q for p, q in zip(*rows)] for rows in zip(self.prior_xx, self.xx)], dtype=torch.float64)
        b = torch.tensor([p + q for p, q in zip(self.prior_xy, self.xy)], dtype=torch.float64)
        try:
            fit = torch.linalg.solve(a, b).clamp_(min=0.0).tolist()
        except RuntimeError:  # singular: the numbers stay as they were
            return
        self.fixed, self.per_row, self.per_row_key, self.gather_per_row_key = \
            fit[0], fit[1], fit[2] / 1000, fit[3] / 1000


class FairShare:
    """
    BatchEngine.row_policy sharing decode steps between the owners of the rows (Sequence.owner: chat_web's clients),
    by what a step costs (a DecodeCost).
    """

    def __init__(self, engine, cost):
        self.engine, self.cost = engine, cost
        self.carried_seconds = 0.0  # allowed but not spent by the last step, while rows waited: the next may spend it
        self.rows_passed_by = 0  # row-steps a sequence with its next token waited for another's turn (/stats)
        self.picked_shape = None  # step_shape of the rows picked last, for step_took
        self.prefilled_at = {}  # owner -> the prefill turn it last had tokens in (prefills: owners take turns)
        self.prefill_turns = 0
        self.prefill_credit = 0.0  # seconds of prefill the other owners' steps have paid for and no chunk has spent
        self.prefill_started = None  # (when, estimated seconds) of the chunk prefills() allowed: pick() charges it

    def pick(self, ready):
        """
        The sequences of `ready` this decode step feeds; the others wait. Every one, unless more than one owner has
        rows ready. Then the light owners, whose rows alone cost at most FAIR_STRETCH times the cheapest owner's, are
        fed whole, and the step may cost FAIR_STRETCH times their step, or, if more, their step plus, for each heavier
        owner, what the heaviest light owner's rows cost beyond the fixed part (15 rows beside 16 are both fed whole).
        The heavier owners' rows join a row each in turn, the longest-waiting first, while the step stays within those
        allowed seconds; an owner whose next row does not fit waits whole. Seconds allowed but not spent while rows
        wait are carried to the next step, so every row gets in within a few steps.
        """
        if self.prefill_started is not None:  # the chunk this step prefilled (and the draws after it), as it ran
            started, estimate = self.prefill_started
            self.prefill_credit -= max(estimate, time.perf_counter() - started)
            self.prefill_started = None
        fed = self._share(ready)
        self.rows_passed_by += len(ready) - len(fed)
        self.picked_shape = self.step_shape(fed) if fed else None
        return fed

    def prefills(self, waiting, room):
        """
        The prompts of `waiting` in the order a step prefills them, and how many of their tokens it may take. Owners
        take turns, the one that had tokens longest ago first (oldest prompt first, a client's 16 long prompts held a
        neighbour's first token for 1-2 s). While other owners' rows decode and none of their prompts waits, the
        prefills cost at most PREFILL_SHARE of those steps: each step earns that share of their cost, a chunk takes
        the tokens the credit pays for by the measured prefill cost, its forward's fixed cost included (so a chunk of
        PREFILL_MIN_TOKENS or more comes every few steps rather than a costly one at each), and is charged what it
        took (timed until the step's pick()), or its estimate if more.
        """
        owners = {}
        for seq in waiting:
            owners.setdefault(seq.owner, []).append(seq)
        ordered = [seq for owner in sorted(owners, key=lambda owner: self.prefilled_at.get(owner, -1))
                   for seq in owners[owner]]
        others = [seq for seq in self.engine.running  # decoding: fed last step, or to be fed this one
                  if seq.owner not in owners and seq.finished is None and (seq.logits is not None or seq.awaiting_feed)]
        if others:
            cost, first = self.cost, ordered[0]
            extent = len(first.prompt)  # where its chunk ends at most: what each token's keys cost up to
            fixed = cost.prefill_seconds(0, extent)
            per_token = cost.prefill_seconds(1, extent) - fixed
            most = fixed + room * per_token  # the credit saved at most: a full chunk's worth
            earned = PREFILL_SHARE * cost.seconds(*self.step_shape(others))
            self.prefill_credit = min(most, self.prefill_credit + earned)
            affordable = min(room, int((self.prefill_credit - fixed) / max(per_token, 1e-12)))
            if affordable < min(room, PREFILL_MIN_TOKENS, len(first.prompt) - first.prefilled):
                return [], 0  # not yet: a chunk of a few tokens would pay the forward's fixed cost for little
            room = affordable
            # pick() charges what the chunk took, if more than the estimate (which runs low on a busy machine)
            self.prefill_started = (time.perf_counter(), fixed + room * per_token)
        else:
            self.prefill_credit = 0.0
        self.prefill_turns += 1
        left = room
        for seq in ordered:
            if left <= 0:
                break
            self.prefilled_at[seq.owner] = self.prefill_turns
            left -= len(seq.prompt) - seq.prefilled
        if len(self.prefilled_at) > 4 * len(self.engine.running) + 64:  # owners long gone: forgotten
            current = {seq.owner for seq in self.engine.running}
            self.prefilled_at = {o: t for o, t in self.prefilled_at.items() if o in current}
        return ordered, room

    def step_took(self, seconds):
        """The step of the rows picked last (and no prompt's chunk) took `seconds`: the cost follows it."""
        self.cost.observe(*self.picked_shape, seconds)

    def step_shape(self, seqs):
        """(rows computed, extent, gathered) of a decode step feeding `seqs`: each writes its key at its length."""
        rows = sorted(seq.row for seq in seqs)
        extent = max(self.engine.cache.lengths[row] for row in rows) + 1
        return self.engine.decode_rows(len(rows)), extent, rows[-1] - rows[0] >= len(rows)

    def _share(self, ready):
        owners = {}
        for seq in ready:
            owners.setdefault(seq.owner, []).append(seq)
        alone = {owner: self.cost.seconds(*self.step_shape(seqs)) for owner, seqs in owners.items()}
        cheapest = min(alone.values(), default=0.0)
        light = [owner for owner in owners if alone[owner] <= FAIR_STRETCH * cheapest]
        if len(light) == len(owners):  # one owner, or owners alike: every row, as without sharing
            self.carried_seconds = 0.0
            return ready
        fed = [seq for owner in light for seq in owners[owner]]
        base = self.cost.seconds(*self.step_shape(fed))
        heavy = [sorted(seqs, key=lambda seq: seq.last_fed) for owner, seqs in owners.items() if owner not in light]
        heavy.sort(key=lambda seqs: seqs[0].last_fed)
        heaviest_light = max(alone[owner] for owner in light) - self.cost.fixed
        allowed_seconds = max(FAIR_STRETCH * base, base + len(heavy) * heaviest_light) + self.carried_seconds
        lengths, rows_of = self.engine.cache.lengths, self.engine.decode_rows
        count, extent = len(fed), max(lengths[seq.row] for seq in fed) + 1
        waits = set()  # owners whose next row did not fit
        for turn in range(max(len(seqs) for seqs in heavy)):
            for i, seqs in enumerate(heavy):
                if turn >= len(seqs) or i in waits:
                    continue
                wider = max(extent, lengths[seqs[turn].row] + 1)
                if self.cost.seconds(rows_of(count + 1), wider, gathered=True) > allowed_seconds:
                    waits.add(i)
                    continue
                fed.append(seqs[turn])
                count, extent = count + 1, wider
        spent = self.cost.seconds(rows_of(count), extent, gathered=True)
        self.carried_seconds = allowed_seconds - spent if waits else 0.0
        return fed


def share_decode_steps(engine, repeats=3):
    """Make FairShare the row policy of a BatchEngine that holds no sequence yet, by a DecodeCost measured on it now
    (after any other add-on has swapped its decode step: the cost is that step's)."""
    engine.row_policy = FairShare(engine, measure_decode_cost(engine, repeats))
    return engine.row_policy


def measure_decode_cost(engine, repeats=3):
    """
    A DecodeCost from whole steps of a BatchEngine timed now, before any sequence is added, on stand-in sequences: one
    row at a short length; several rows (what a row adds); the same at half the context (what keys add); and
    scattered (what gathering adds). Each shape's time is the fastest of a few steps in a row (as in serving, where a
    step follows one of its kind), timed `repeats` times in turn so that a burst of other work slows them alike.
    """
    if engine.running or engine.num_waiting:
        raise RuntimeError("measure_decode_cost times empty rows: call it before adding sequences")
    many = 1 << (min(8, engine.max_batch).bit_length() - 1)  # a power of two: a bf16 CPU pads no row to it
    short = min(32, engine.context // 2)
    long = max(short, engine.context // 2)
    if many == 1 or long == short:
        return DecodeCost(fixed=min(_time_steps(engine, [0], short) for _ in range(repeats)), per_row=0.0,
                          per_row_key=0.0)
    run, scattered = list(range(many)), list(range(0, 2 * many, 2)) if 2 * many <= engine.max_batch else None
    shapes = [([0], short), (run, short), (run, long)] + ([(scattered, long)] if scattered else [])
    best = [float("inf")] * len(shapes)
    counters, policy = (engine.decode_steps, engine.shared_steps), engine.row_policy
    engine.row_policy = None  # every stand-in row fed
    for attempt in range(repeats + 1):  # the first round warms up: a fresh process's first steps are slower
        for i, shape in enumerate(shapes):
            seconds = _time_steps(engine, *shape)
            best[i] = min(best[i], seconds) if attempt else best[i]
    (engine.decode_steps, engine.shared_steps), engine.row_policy = counters, policy  # stand-ins are no one's steps
    prefill = measure_prefill_cost(engine, short, long, repeats)
    one, run_short, run_long = best[:3]
    per_row_key = max(0.0, (run_long - run_short) / (many * (long - short)))
    row_at_short = max(0.0, (run_short - one) / (many - 1))  # per_row + per_row_key * short
    gather = max(0.0, (best[3] - run_long) / (many * long)) if scattered else 0.0
    timed = [(1, short + 1, False), (many, short + 1, False), (many, long + 1, False), (many, long + 1, True)]
    return DecodeCost(fixed=max(0.0, one - row_at_short), per_row=max(0.0, row_at_short - per_row_key * short),
                      per_row_key=per_row_key, gather_per_row_key=gather, measured=timed, prefill=prefill)


def measure_prefill_cost(engine, short, long, repeats=3):
    """(fixed, per token, per token and key position) of a prompt's chunk, from chunks of a stand-in prompt timed now:
    a few tokens and many at the start of a row, and many after `long` positions; the fastest of `repeats` each."""
    many = min(engine.prefill_chunk, max(8, long - short))
    few = max(1, many // 16)
    shapes = [(few, 0), (many, 0), (many, long - many)]
    best = [min(_time_prefill(engine, tokens, start) for _ in range(repeats + 1)) for tokens, start in shapes]
    per_token = max(0.0, (best[1] - best[0]) / (many - few))
    per_token_key = max(0.0, (best[2] - best[1]) / (many * (long - many)))
    return max(0.0, best[0] - few * per_token), per_token, per_token_key


def _time_prefill(engine, tokens, start):
    """Seconds of one prefill chunk of `tokens` prompt tokens written after `start` positions of a free row."""
    row = engine.free_rows[0]
    seq = Sequence([0] * (start + tokens), Sampling(), prefilled=start)
    seq.leader, seq.row = seq, row
    engine.cache.lengths[row] = start
    running, policy, engine.running, engine.row_policy = engine.running, engine.row_policy, [seq], None
    try:
        started = time.perf_counter()
        with torch.inference_mode():
            engine._prefill()
        return time.perf_counter() - started
    finally:
        engine.running, engine.row_policy = running, policy
        engine.cache.reset(row)


def _time_steps(engine, rows, length, steps=4):
    """The fastest of `steps` steps (after a warm-up) of stand-in sequences on `rows`, each holding about `length`
    positions (whatever is in them), sampling as chat_web does by default."""
    engine.free_rows = [row for row in engine.free_rows if row not in rows]
    seqs = []
    for row in rows:
        seq = Sequence([0], Sampling(temperature=0.6, top_k=50), prefilled=1, next_input=0, awaiting_feed=True)
        seq.leader, seq.row = seq, row
        seq.generator = torch.Generator(device=engine.device).manual_seed(0)
        engine.cache.lengths[row] = length - 1
        engine.running.append(seq)
        seqs.append(seq)
    engine.step()  # fed: their logits are ready
    fastest = float("inf")
    for _ in range(steps):  # each samples them (reading the tokens back: the device has finished) and feeds them
        started = time.perf_counter()
        engine.step()
        fastest = min(fastest, time.perf_counter() - started)
    for seq in seqs:
        engine.cancel(seq)  # its row is free and empty again (one that drew a stop token has left already)
    heapq.heapify(engine.free_rows)
    return fastest
