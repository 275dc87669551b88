"""The parts of a rolled layer: its ops cut sub-module by sub-module, so that a rolled loop
gathers, releases and prefetches inside each iteration as the unrolled planner does
between segments (`max_live_parameters`, `prefetch_bucket_size`, `max_reuse_distance`).

A part is a run of the first layer's ops (roll.Run's template) that starts where a bucket
not in use yet is needed, as segments do (plan.py). Each iteration of the forward loop
walks the body's steps: gather a bucket of this layer, compute a part, release. The
backward loop's body first recomputes the layer part by part (each part under `jax.vjp`,
its gathered weights stripped from the saved residuals, as segments are), then applies
the parts' vjps in reverse, re-gathering the buckets that were released, and
reduce-scatters each bucket's layer gradient after its last use.

What runs is pure code over callbacks (gather, scatter), shared by the planner and the
executor: the planner traces the backward body with every gather as an input and drops the
gathers that JAX's dead-code elimination (what jit applies) finds unused, so the schedule
says exactly which collectives the compiled program keeps.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax._src.interpreters import partial_eval as pe  # JAX's own DCE (as segments.py)

from zjax._src.program import roll
from zjax._src.program import segments as seg_lib
from zjax._src.program.trace import LAYOUT_PRIMITIVES, sub_jaxprs
from zjax._src.schedule import ir


@dataclasses.dataclass(frozen=True)
class PartIO:
  """What part p of the template reads from outside itself and defines for later."""

  start: int  # template op range [start, end)
  end: int
  positions: tuple[int, ...]  # gathered stacked positions (weights) its ops read
  inputs: tuple  # context keys: ("local", j, o) (an earlier part's), ("const"|"carry"|"xs", k)
  outputs: tuple  # ("local", j, o) it defines that later ops read or the loop carries out
  weights: tuple  # weight keys it reads (PartRunner)


def part_runner(program, run, members, entries, bucket_of, whole=False) -> "PartRunner":
  """The PartRunner of a rolled run (shared by the planner and the executor): members[b]
  are bucket b's layer-0 parameter indices, bucket_of maps a layer-0 parameter to its
  bucket, entries are the parameters (persistent ones are not gathered); `whole`: the
  layer as one part (a loop that gathers its whole layer at once)."""
  template = roll.template_ops(program, run)
  sharded = {
    p: layers[0] for p, layers in enumerate(run.stacked) if not entries[layers[0]].persistent
  }
  replicated = [p for p in range(len(run.stacked)) if p not in sharded]
  avals = {}
  for j, sources in enumerate(run.sources):
    for q, src in enumerate(sources):
      if src[0] == "layer" and src[1] in sharded:
        avals[src[1]] = template[j].eqn.invars[q].aval
  trained = {i for i in sharded.values() if ir.has_gradient(entries[i])}
  needs = seg_lib.needs_gradient(program, [ir.has_gradient(e) for e in entries])
  return PartRunner(
    run,
    template,
    sharded,
    replicated,
    members,
    bucket_of,
    trained,
    avals,
    differentiable_inputs(run, replicated, entries, needs),
    whole,
  )


def differentiable_inputs(run, replicated, entries, needs_gradient) -> frozenset:
  """The loop inputs a backward iteration differentiates besides its carries: the consts
  that depend on trained parameters (`needs_gradient`: program value ids) and the trained
  persistent per-layer parameters. Not the others, as jax.value_and_grad would not: they
  may feed ops JAX cannot transpose (a while_loop on a float from the batch)."""
  consts = [("const", k) for k, v in enumerate(run.consts) if v in needs_gradient]
  if run.body is not None:  # a scan's xs: program values, differentiated as consts are
    consts += [("xs", k) for k, v in enumerate(run.xs) if v in needs_gradient]
  stacks = [
    ("xs", len(run.xs) + r)
    for r, p in enumerate(replicated)
    if ir.has_gradient(entries[run.stacked[p][0]])
  ]
  return frozenset(consts + stacks)


def weight_views(template, sources, gathered) -> dict:
  """(op, output) -> (stacked position, its layout ops from the gathered layer) for each
  template op that views a gathered weight (`gathered`: those positions): a reshape /
  transpose / cast chain with one input, which the parts apply where they read it, as
  segments apply views, so that saved residuals never hold a weight's copy."""
  views = {}
  for j, (op, srcs) in enumerate(zip(template, sources)):
    reads = [s for s in srcs if s[0] != "lit"]
    if op.primitive not in LAYOUT_PRIMITIVES or len(reads) != 1 or len(op.outputs) != 1:
      continue
    src = reads[0]
    if src[0] == "layer" and src[1] in gathered:
      views[(j, 0)] = (src[1], (op,))
    elif src[0] == "local" and (src[1], src[2]) in views:
      base, chain = views[(src[1], src[2])]
      views[(j, 0)] = (base, chain + (op,))
  return views


class PartRunner:
  """Runs the template's parts on one iteration's values (concrete or abstract).

  Weights are what a part reads of its gathered parameters: a parameter ("layer", q) or a
  layout view of one ("view", j, o: a reshape/transpose/cast chain, applied when the part
  runs, as segments apply views), so that saved residuals never hold a weight's copy."""

  def __init__(
    self,
    run,
    template,
    gathered: dict,
    replicated: list,
    members,
    bucket_of,
    trained: set,
    weight_avals: dict,
    differentiable: frozenset,
    whole: bool = False,
  ):
    """gathered: stacked position -> layer-0 parameter index (gathered per iteration);
    replicated: positions read whole from the xs (persistent); members: bucket -> its
    layer-0 parameter indices; trained: parameter indices that get a gradient;
    weight_avals: position -> the weight's shape and dtype (as gathered); differentiable:
    the const and xs context keys that get a cotangent (`differentiable_inputs`); whole:
    one part, the whole layer."""
    self.run, self.template = run, template
    self.differentiable = differentiable
    self.gathered, self.replicated, self.members = gathered, replicated, members
    self.trained, self.weight_avals = trained, weight_avals
    self.views = weight_views(template, run.sources, gathered)
    self.bucket_of = {q: bucket_of[i] for q, i in gathered.items()}
    cuts = [(0, len(run.sources))] if whole else self._cut()
    self.parts = [self._io(a, b) for a, b in cuts]

  @property
  def out_keys(self) -> list:
    """The context keys an iteration outputs: its carries, then a scan's stacked ys."""
    return list(self.run.out_keys) or [("local", j, o) for j, o in self.run.carry_out]

  def weight_key(self, src):
    """("layer", q) or ("view", j, o) if the input is a gathered weight or a view of one."""
    if src[0] == "layer" and src[1] in self.gathered:
      return ("layer", src[1])
    if src[0] == "local" and (src[1], src[2]) in self.views:
      return ("view", src[1], src[2])
    return None

  def base_of(self, key):
    return (key[1], ()) if key[0] == "layer" else self.views[(key[1], key[2])]

  def _is_view_op(self, j) -> bool:
    return (j, 0) in self.views

  def _cut(self) -> list[tuple[int, int]]:
    """Template op ranges of the parts: a part starts where an op reads a bucket that the
    current part does not use (as segments are cut)."""
    ranges, start, current = [], 0, set()
    for j, sources in enumerate(self.run.sources):
      if self._is_view_op(j):
        continue
      needed = {
        self.bucket_of[self.base_of(k)[0]]
        for k in (self.weight_key(s) for s in sources)
        if k is not None
      }
      if current and needed and not needed <= current:
        ranges.append((start, j))
        start, current = j, set()
      current |= needed
    ranges.append((start, len(self.run.sources)))
    return ranges

  def _io(self, a, b) -> PartIO:
    weights, inputs = [], []
    for j in range(a, b):
      if self._is_view_op(j):
        continue
      for src in self.run.sources[j]:
        wkey, key = self.weight_key(src), self.context_key(src)
        if wkey is not None:
          if wkey not in weights:
            weights.append(wkey)
        elif key is not None and not (key[0] == "local" and a <= key[1] < b) and key not in inputs:
          inputs.append(key)
    later = {
      self.context_key(s)
      for j in range(b, len(self.run.sources))
      if not self._is_view_op(j)
      for s in self.run.sources[j]
    }
    later |= set(self.out_keys)
    outputs = [
      ("local", j, o)
      for j in range(a, b)
      if not self._is_view_op(j)
      for o in range(len(self.template[j].outputs))
      if ("local", j, o) in later
    ]
    positions = tuple(dict.fromkeys(self.base_of(k)[0] for k in weights))
    return PartIO(a, b, positions, tuple(inputs), tuple(outputs), tuple(weights))

  def context_key(self, src):
    """Where an op input comes from in the iteration's context; None for literals and
    weights."""
    kind = src[0]
    if kind == "local":
      return None if (src[1], src[2]) in self.views else src
    if kind in ("const", "carry", "xs"):
      return (kind, src[1])
    if kind == "layer" and src[1] not in self.gathered:
      return ("xs", len(self.run.xs) + self.replicated.index(src[1]))
    return None

  def part_fn(self, p):
    """(weights: weight key -> value, [values of part.inputs]) -> [values of outputs]."""
    part = self.parts[p]

    def run(weights, inputs):
      env = dict(zip(part.inputs, inputs))
      for j in range(part.start, part.end):
        if self._is_view_op(j):
          continue
        args = []
        for src in self.run.sources[j]:
          wkey = self.weight_key(src)
          args.append(
            src[1]
            if src[0] == "lit"
            else weights[wkey]
            if wkey is not None
            else env[self.context_key(src)]
          )
        env.update(
          (("local", j, o), v) for o, v in enumerate(seg_lib.apply_op(self.template[j], args))
        )
      return [env[key] for key in part.outputs]

    return run

  def forward(self, p, weights, ctx):
    outs = self.part_fn(p)(weights, [ctx[k] for k in self.parts[p].inputs])
    ctx.update(zip(self.parts[p].outputs, outs))

  def vjp(self, p, weights, ctx):
    """Part p under jax.vjp with respect to its trained weights and float inputs ->
    (outputs, vjp_fn, backward(vjp_fn, output cts) -> (weight cts by base position, input
    cts by context key))."""
    part, run = self.parts[p], self.part_fn(p)
    diff_w = [k for k in part.weights if self.gathered[self.base_of(k)[0]] in self.trained]
    values = [ctx[k] for k in part.inputs]
    diff_in = [
      i
      for i, (k, v) in enumerate(zip(part.inputs, values))
      if _is_float(v) and (k[0] in ("local", "carry") or k in self.differentiable)
    ]

    def f(w, xs):
      all_in = list(values)
      for i, x in zip(diff_in, xs):
        all_in[i] = x
      return run({**weights, **dict(zip(diff_w, w))}, all_in)

    outs, vjp_fn = jax.vjp(f, [weights[k] for k in diff_w], [values[i] for i in diff_in])

    def backward(vjp_fn, cts):
      ct_w, ct_in = vjp_fn(cts)
      by_position = {}
      for key, ct in zip(diff_w, ct_w):
        q, chain = self.base_of(key)
        if chain:  # back through the layout ops (all linear)
          aval = self.weight_avals[q]
          (ct,) = jax.linear_transpose(
            lambda x: seg_lib.apply_chain(chain, x), jax.ShapeDtypeStruct(aval.shape, aval.dtype)
          )(ct)
        by_position[q] = ct if q not in by_position else by_position[q] + ct
      return by_position, {part.inputs[i]: c for i, c in zip(diff_in, ct_in)}

    return outs, vjp_fn, backward

  def weights(self, p, layers, placeholder=None) -> dict:
    """Weight key -> its value from this layer's gathered parameters; where a bucket is not
    gathered, zeros (the planner proved the value unused: dead code that XLA deletes), or
    placeholder(position)."""
    out, bases = {}, {}
    for key in self.parts[p].weights:
      q, chain = self.base_of(key)
      if q not in bases:
        i, aval = self.gathered[q], self.weight_avals[q]
        bases[q] = (
          layers[i]
          if i in layers
          else (placeholder(q) if placeholder else jnp.zeros(aval.shape, aval.dtype))
        )
      out[key] = seg_lib.apply_chain(chain, bases[q])
    return out


def walk_forward(runner, body, ctx, gather, tie):
  """One forward iteration: the body's steps in order; `ctx` (context key -> value) gains
  every part's outputs. gather(bucket, tie) -> {layer-0 param index: this layer's value}."""
  layers = {}
  for st in body:
    if st.op == "gather":
      layers.update(gather(st.bucket, tie))
    elif st.op == "release":
      layers = _released(runner, layers, st.bucket)
    elif st.op == "compute":
      runner.forward(st.part, runner.weights(st.part, layers), ctx)
      tie = _last_output(runner, st.part, ctx, tie)
  return ctx


def walk_backward(runner, body, ctx, cts, gather, scatter, tie, placeholder=None):
  """One backward iteration: recompute steps run a part under vjp (its saved residuals
  without gathered weights), compute steps apply it, re-gathering where the body says;
  scatter(bucket, {param index: layer gradient}) at each reduce-scatter. cts: context key
  -> cotangent (the carried-out values' on entry; every input's on return).
  placeholder(op, part, position) stands in for a weight whose bucket is not gathered."""
  layers, saved, grads = {}, {}, {}
  for st in body:
    if st.op == "gather":
      layers.update(gather(st.bucket, tie))
    elif st.op == "release":
      layers = _released(runner, layers, st.bucket)
    elif st.op == "recompute":
      weights = runner.weights(st.part, layers, _hole(placeholder, st))
      outs, vjp_fn, backward = runner.vjp(st.part, weights, ctx)
      ctx.update(zip(runner.parts[st.part].outputs, outs))
      stripped = seg_lib.strip_params(vjp_fn, list(weights.values()))
      saved[st.part] = (stripped, backward)
      # what its vjp will read: XLA's algebraic simplifier drops a barrier's tie that
      # nothing else reads, and the part's outputs may be unread (the layer's output).
      # Not the outputs as well: a tie keeps what it ties alive, and an unread output's
      # recompute (a row-parallel matmul and its all-reduce) would then run for nothing.
      tie = _residuals(stripped) or [_last_output(runner, st.part, ctx, tie)]
    elif st.op == "compute":
      stripped, backward = saved.pop(st.part)
      weights = runner.weights(st.part, layers, _hole(placeholder, st))
      vjp_fn = seg_lib.restore_params(stripped, list(weights.values()))
      outputs = runner.parts[st.part].outputs
      ct_w, ct_in = backward(
        vjp_fn, [cts[k] if k in cts else seg_lib.zero_cotangent(ctx[k]) for k in outputs]
      )
      for q, c in ct_w.items():
        i = runner.gathered[q]
        grads[i] = c if i not in grads else grads[i] + c
      for k, c in ct_in.items():
        cts[k] = c if k not in cts else cts[k] + c
      # what this vjp made (a cotangent passed straight through, e.g. of a residual add,
      # would tie a re-gather to the same value as an earlier gather: XLA merges the two)
      tie = (list(ct_w.values()) + list(ct_in.values())) or tie
    elif st.op == "reduce_scatter":
      scatter(st.bucket, {i: grads.pop(i) for i in runner.members[st.bucket] if i in grads})
  return cts


def _residuals(stripped) -> list:
  """The arrays a stripped vjp saved (its gathered weights left out)."""
  _, kept, _ = stripped
  return [x for x in kept if isinstance(x, jax.Array | jax.core.Tracer)]


def _hole(placeholder, st):
  return None if placeholder is None else lambda q: placeholder(st.op, st.part, q)


def _released(runner, layers, bucket):
  gone = set(runner.members[bucket])
  return {i: v for i, v in layers.items() if i not in gone}


def _last_output(runner, p, ctx, tie):
  outputs = runner.parts[p].outputs
  return ctx[outputs[-1]] if outputs else tie


def _is_float(x) -> bool:
  return x is not None and ir.is_float(jnp.result_type(x))


# ---- analysis (the planner's; the executor checks edited bodies with it) --------------------
def context_avals(runner) -> dict:
  """Context key -> the value's shape and dtype, for every key the template reads (and a
  scan's inputs, which an iteration may pass straight to an output)."""
  out, run = {}, runner.run
  if run.body is not None:
    counts = {"const": len(run.consts), "carry": len(run.carry_in), "xs": len(run.xs)}
    start = 0
    for kind, count in counts.items():
      for k in range(count):
        out[(kind, k)] = run.body.avals[run.body.input_ids[start + k]]
      start += count
  for j, sources in enumerate(runner.run.sources):
    for q, src in enumerate(sources):
      key = runner.context_key(src)
      if key is not None and key[0] != "local":
        out[key] = runner.template[j].eqn.invars[q].aval
    for o, v in enumerate(runner.template[j].eqn.outvars):
      out[("local", j, o)] = v.aval
  return out


def unused_gathers(runner, body) -> tuple[set[int], set[tuple]]:
  """(positions in the backward `body` of gathers whose values the iteration's results do
  not depend on, (op, part, position) of weights a recompute or compute step reads while
  their bucket is not gathered but whose values the results do depend on), by JAX's
  dead-code elimination. The planner drops the first; an edited body with the second is
  wrong (the executor refuses it)."""
  _, used, gathers, holes = _traced_backward(runner, body)
  used = iter(used)
  gather_used = [any([next(used) for _ in runner.members[body[k].bucket]]) for k in gathers]
  hole_used = [next(used) for _ in holes]
  return (
    {k for k, u in zip(gathers, gather_used) if not u},
    {h for h, u in zip(holes, hole_used) if u},
  )


def backward_op_signatures(runner, body) -> set[tuple]:
  """(primitive, shapes of its operands, its dimension numbers) of every matmul and gather
  that the backward `body` executes after dead-code elimination, inside nested calls too:
  a forward op of the layer with the same signature is recomputed there (tensor_comm.py
  counts its collectives again)."""
  jaxpr, *_ = _traced_backward(runner, body)
  return op_signatures(jaxpr)


def op_signatures(jaxpr) -> set[tuple]:
  """`op_signature` of every matmul and gather of `jaxpr`, inside nested calls too."""
  out = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("dot_general", "gather"):
      out.add(op_signature(eqn))
    for _, sub, _ in sub_jaxprs(eqn):
      out |= op_signatures(sub)
  return out


def op_signature(eqn) -> tuple:
  return (
    eqn.primitive.name,
    tuple(tuple(v.aval.shape) for v in eqn.invars),
    str(eqn.params.get("dimension_numbers")),
  )


def _traced_backward(runner, body):
  """The backward `body` traced on one iteration's abstract values, JAX's dead-code
  elimination applied: (the pruned jaxpr, whether each gathered weight (per gather step)
  and each weight read while its bucket is not gathered (`holes`) is used, the gather
  steps' positions, the holes)."""
  avals = context_avals(runner)
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
  member_avals = {runner.gathered[q]: spec(a) for q, a in runner.weight_avals.items()}
  gathers = [k for k, st in enumerate(body) if st.op == "gather"]
  holes = [
    (st.op, st.part, q)
    for st in body
    if st.op in ("recompute", "compute")
    for q in runner.parts[st.part].positions
  ]
  computed = {k for st in body if st.op == "recompute" for k in runner.parts[st.part].outputs}
  ctx_keys = [k for k in avals if k[0] != "local"] + sorted(
    {
      k
      for st in body
      if st.op == "recompute"
      for k in runner.parts[st.part].inputs
      if k[0] == "local" and k not in computed
    }
  )
  ct_keys = [k for k in dict.fromkeys(runner.out_keys) if ir.is_float(avals[k].dtype)]

  def run(gathered, ctx_values, ct_values, hole_values):
    values, fill, scattered = iter(gathered), dict(zip(holes, hole_values)), []
    cts = walk_backward(
      runner,
      body,
      dict(zip(ctx_keys, ctx_values)),
      dict(zip(ct_keys, ct_values)),
      lambda b, tie: dict(zip(runner.members[b], next(values))),
      lambda b, grads: scattered.extend(grads.values()),
      None,
      lambda op, p, q: fill[(op, p, q)],
    )
    return [cts[k] for k in ctx_keys if k in cts] + scattered

  closed = jax.make_jaxpr(run)(
    [[member_avals[i] for i in runner.members[body[k].bucket]] for k in gathers],
    [spec(avals[k]) for k in ctx_keys],
    [spec(avals[k]) for k in ct_keys],
    [member_avals[runner.gathered[q]] for _, _, q in holes],
  )
  jaxpr, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
  weights = sum(len(runner.members[body[k].bucket]) for k in gathers)
  skipped = len(ctx_keys) + len(ct_keys)
  return jaxpr, used[:weights] + used[weights + skipped :], gathers, holes


def backward_reads(runner, p, bucket_of_position) -> tuple[int, ...]:
  """Buckets whose values part p's vjp reads (its saved residuals hold no weights)."""
  buckets = sorted({bucket_of_position[q] for q in runner.parts[p].positions})
  body = [_step("gather", b) for b in buckets] + [_step("recompute", part=p)]
  body += [_step("release", b) for b in buckets] + [_step("gather", b) for b in buckets]
  body += [_step("compute", part=p)]
  unused, _ = unused_gathers(runner, body)
  second = len(buckets) * 2 + 1
  return tuple(b for k, b in enumerate(buckets) if second + k not in unused)


def _step(op, bucket=None, part=None):
  return ir.Step(op, bucket=bucket, part=part)
