"""Segments as code: what a segment reads and defines, how to run it, and what its backward
needs. Shared by the planner (which must know which buckets a backward step reads) and the
executor (which runs the segments), so that both see the same residuals.

A segment runs its ops with parameter *views* (a parameter, or a reshape/transpose/cast of
one: applied lazily at the use) and activations as inputs. Its backward is its `jax.vjp`
with every residual that *is* a parameter view replaced by a slot, filled at backward time
from the re-gathered bucket: saved residuals never hold gathered parameters.
"""

import dataclasses

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

# JAX has no public dead-code elimination; this one is what jit itself applies.
from jax._src.interpreters import partial_eval as pe
from jax.ad_checkpoint import checkpoint_name

from zjax._src.program import conv_rule
from zjax._src.program.program import FlatProgram
from zjax._src.program.trace import LAYOUT_PRIMITIVES, param_views, sub_jaxprs
from zjax._src.schedule import ir


@dataclasses.dataclass
class SegmentIO:
  ops: list  # the ops to run (lazy layout views of parameters excluded)
  param_inputs: list[int]  # parameter views it reads
  act_inputs: list[int]  # other values it reads
  outputs: list[int]  # values it defines that later segments (or the result) read


@dataclasses.dataclass
class Analysis:
  """The program cut into segments, as both the planner and the executor see it."""

  views: dict  # value id -> parameter indices it is a layout view of
  chains: dict  # view id -> (parameter index, layout ops from the parameter to the view)
  ios: list[SegmentIO]
  diff_params: list[list[bool]]  # per segment: which param inputs are differentiated
  diff_acts: list[list[bool]]  # per segment: which activation inputs are differentiated
  replicated: list[list[bool]]  # per segment: which param inputs are persistent (whole)


def analyze(
  program: FlatProgram, segments, trained: list[bool], persistent: list[bool]
) -> Analysis:
  """Segment inputs and outputs, which inputs depend on trained parameters (only those
  are differentiated, as in jax.value_and_grad) and which parameters are persistent."""
  views = param_views(program, len(trained))
  chains = view_chains(program, views, len(trained))
  ios = segment_ios(program, segments, views)
  wanted = needs_gradient(program, trained)
  return Analysis(
    views,
    chains,
    ios,
    [[trained[chains[v][0]] for v in io.param_inputs] for io in ios],
    [[a in wanted for a in io.act_inputs] for io in ios],
    [[persistent[chains[v][0]] for v in io.param_inputs] for io in ios],
  )


def is_lazy_view(op, views) -> bool:
  return op.primitive in LAYOUT_PRIMITIVES and all(o in views for o in op.outputs)


def segment_ios(program: FlatProgram, segments, views) -> list[SegmentIO]:
  readers = _last_readers(program, segments, views)
  result = []
  for seg in segments:
    ops = [op for op in program.ops[seg.start : seg.end] if not is_lazy_view(op, views)]
    defined, params, acts = set(), [], []
    for op in ops:
      for a in op.inputs:
        if isinstance(a, int) and a not in defined:
          target = params if a in views else acts
          if a not in target:
            target.append(a)
      defined.update(op.outputs)
    outputs = [o for op in ops for o in op.outputs if readers.get(o, -1) > seg.id]
    result.append(SegmentIO(ops, params, acts, outputs))
  return result


def view_chains(program: FlatProgram, views, num_params) -> dict[int, tuple[int, tuple]]:
  """View id -> (parameter index, layout ops that turn the parameter into the view)."""
  chains = {program.input_ids[i]: (i, ()) for i in range(num_params)}
  for op in program.ops:
    if is_lazy_view(op, views):
      (src,) = [a for a in op.inputs if isinstance(a, int)]
      param, chain = chains[src]
      for out in op.outputs:
        chains[out] = (param, chain + (op,))
  return chains


def needs_gradient(program: FlatProgram, trained: list[bool]) -> set[int]:
  """Ids of values that depend on a trained parameter (their cotangents matter)."""
  dependent = {program.input_ids[i] for i, t in enumerate(trained) if t}
  for op in program.ops:
    if any(isinstance(a, int) and a in dependent for a in op.inputs):
      dependent.update(op.outputs)
  return dependent


# Residual policy of a segment's vjp: keep the outputs of matmuls and convolutions (costly to
# recompute) and recompute elementwise work in backward. Measured on the 8-layer GPT example
# (8 devices): per-device temp 14.3 -> 8.3 MiB at the same step time (keeping everything that
# jax.vjp saves per segment duplicates residuals that one whole-program vjp would share).
# Only the segment's own ops are kept, by name: a matmul inside a loop body (an LSTM's gates
# in a scan over time) would be kept once per iteration, stacked, beside the residuals that
# the loop's backward recomputes anyway.
SAVED_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})
_SAVED_NAME = "zjax_segment_matmul"
_POLICY = jax.checkpoint_policies.save_only_these_names(_SAVED_NAME)


def segment_fn(io: SegmentIO, differentiated=frozenset(), replicated=frozenset()):
  """`(param view values, activation values) -> output values` of a segment, rematerialised
  in backward except for the outputs of its matmuls and convolutions (its own ops, not
  those inside a loop or other higher-order op). `differentiated`: the inputs whose
  cotangents are wanted; `replicated`: the views of persistent parameters, whose weight
  gradients may be computed promptly (`_weight_gradient_first`)."""

  def run(params, acts):
    env = dict(zip(io.param_inputs, params))
    env.update(zip(io.act_inputs, acts))
    perturbed = set(differentiated)
    param_views = set(io.param_inputs)
    for op in io.ops:
      args = [a.val if isinstance(a, jex.Literal) else env[a] for a in op.inputs]
      if _weight_gradient_first(op, replicated, perturbed):
        outs = [_promptly_differentiated(op)(*args)]
      elif conv_rule.kernel_dominated(op, param_views, perturbed):
        outs = [conv_rule.conv_as_patch_matmul(op, op.inputs[0] in perturbed)(*args)]
      else:
        outs = apply_op(op, args)
      if op.primitive in SAVED_PRIMITIVES:
        outs = [checkpoint_name(o, _SAVED_NAME) for o in outs]
      if any(isinstance(a, int) and a in perturbed for a in op.inputs):
        perturbed.update(op.outputs)
      env.update(zip(op.outputs, outs))
    return [env[o] for o in io.outputs]

  return jax.checkpoint(run, policy=_POLICY)


def _weight_gradient_first(op, replicated, perturbed) -> bool:
  """Whether `op`, a matmul or convolution of a persistent parameter's view (in
  `replicated`) by an activation, both differentiated (in `perturbed`), computes its weight
  gradient as soon as its output's cotangent arrives, tied to the activation's cotangent.
  Left free, XLA deferred the weight gradients of a data-parallel segment to its end (only
  the gradients' all-reduce reads them), keeping every convolution's input and cotangent
  alive until then (ResNet-18's layout at width 4: 1.34x GSPMD's temp, now 0.92x). Only
  where the weight is smaller than those two, as a prompt gradient lives until the
  reduction instead: a transformer's projection keeps XLA's order. A gathered weight keeps
  it too; its segment is short, and prompt gradients there measured worse (the sharded
  ResNet of tests/real_models.py: 1.35x -> 1.45x GSPMD)."""
  if op.primitive not in SAVED_PRIMITIVES or len(op.inputs) != 2:
    return False
  if not all(isinstance(a, int) and a in perturbed for a in op.inputs):
    return False
  weights = [j for j, a in enumerate(op.inputs) if a in replicated]
  avals = [v.aval for v in op.eqn.invars]
  if len(weights) != 1 or not all(jnp.issubdtype(a.dtype, jnp.inexact) for a in avals):
    return False
  others = [a for j, a in enumerate(avals) if j != weights[0]] + [op.eqn.outvars[0].aval]
  return ir.aval_bytes(avals[weights[0]]) < sum(map(ir.aval_bytes, others))


def _promptly_differentiated(op):
  """`op` whose backward returns both operand cotangents through one optimization barrier,
  so that neither is read (the activation's by the backward that follows) before both are
  computed. The residuals are the operands, as `op`'s own rule keeps them."""

  def run(lhs, rhs):
    (out,) = apply_op(op, [lhs, rhs])
    return out

  def forward(lhs, rhs):
    return run(lhs, rhs), (lhs, rhs)

  def backward(operands, ct):
    _, vjp_fn = jax.vjp(run, *operands)
    return jax.lax.optimization_barrier(vjp_fn(ct))

  promptly = jax.custom_vjp(run)
  promptly.defvjp(forward, backward)
  return promptly


def segment_vjp(io: SegmentIO, params, acts, diff_params, diff_acts, replicated):
  """(outputs, vjp_fn) of the segment with respect to the inputs flagged differentiable
  (those that depend on trained parameters); the others are constants, as in
  jax.value_and_grad. `replicated` flags the persistent parameters' views.
  vjp_fn(cts) -> (cotangents of the flagged params, of the flagged acts).
  """
  run = segment_fn(
    io,
    frozenset(
      [v for v, d in zip(io.param_inputs, diff_params) if d]
      + [a for a, d in zip(io.act_inputs, diff_acts) if d]
    ),
    frozenset(v for v, r in zip(io.param_inputs, replicated) if r),
  )

  def differentiable(dp, da):
    it_p, it_a = iter(dp), iter(da)
    all_p = [next(it_p) if d else p for p, d in zip(params, diff_params)]
    all_a = [next(it_a) if d else a for a, d in zip(acts, diff_acts)]
    return run(all_p, all_a)

  return jax.vjp(
    differentiable,
    [p for p, d in zip(params, diff_params) if d],
    [a for a, d in zip(acts, diff_acts) if d],
  )


def apply_op(op, invals) -> list:
  eqn = op.eqn
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
  return list(out) if eqn.primitive.multiple_results else [out]


def apply_chain(chain, value):
  for op in chain:
    (value,) = apply_op(op, [value])
  return value


def strip_params(vjp_fn, params):
  """(treedef, residuals, slots): residuals that are parameter views become slots, keyed by
  leaf position, holding the view's position in `params`."""
  leaves, treedef = jax.tree_util.tree_flatten(vjp_fn)
  positions = {id(p): j for j, p in enumerate(params)}
  slots = {k: positions[id(leaf)] for k, leaf in enumerate(leaves) if id(leaf) in positions}
  kept = [None if k in slots else leaf for k, leaf in enumerate(leaves)]
  return treedef, kept, slots


def restore_params(stripped, params):
  treedef, kept, slots = stripped
  leaves = [params[slots[k]] if k in slots else leaf for k, leaf in enumerate(kept)]
  return jax.tree_util.tree_unflatten(treedef, leaves)


def backward_param_reads(
  io: SegmentIO, avals, diff_params, diff_acts, replicated
) -> tuple[set[int], set[int]]:
  """(positions in `io.param_inputs` whose values the segment's backward reads, those of
  them that a gather of the backward reads: lookups the vjp recomputes, as the residual
  policy keeps matmul outputs only).

  The backward is the vjp with saved residuals, as the executor runs it (same inputs
  differentiated); a parameter view is needed when a slot holding it feeds a cotangent,
  per dead-code analysis of the backward's jaxpr.
  """
  if not io.param_inputs:
    return set(), set()
  p_avals = [_spec(avals[v]) for v in io.param_inputs]
  a_avals = [_spec(avals[a]) for a in io.act_inputs]
  box = {}

  def forward(params, acts):
    outs, vjp_fn = segment_vjp(io, params, acts, diff_params, diff_acts, replicated)
    box["stripped"] = strip_params(vjp_fn, params)
    box["outs"] = [_spec(o) for o in outs]
    return [leaf for leaf in box["stripped"][1] if leaf is not None]

  kept_avals = jax.eval_shape(forward, p_avals, a_avals)
  treedef, kept, slots = box["stripped"]
  slot_avals = {k: p_avals[j] for k, j in slots.items()}
  cts = [_cotangent_spec(o) for o in box["outs"]]

  def backward(kept_leaves, slot_leaves, cts):
    it_kept, it_slot = iter(kept_leaves), iter(slot_leaves)
    leaves = [next(it_slot) if k in slots else next(it_kept) for k in range(len(kept))]
    ct_params, ct_acts = jax.tree_util.tree_unflatten(treedef, leaves)(cts)
    return list(ct_params) + list(ct_acts)

  slot_order = sorted(slot_avals)
  closed = jax.make_jaxpr(backward)(kept_avals, [slot_avals[k] for k in slot_order], cts)
  # JAX's own dead-code elimination, which looks inside remat, jit, scan, cond and while
  # (as XLA will)
  jaxpr, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
  first_slot = len(kept_avals)
  invars = closed.jaxpr.invars  # the pruned jaxpr keeps the used ones (the same vars)
  slot_vars = {invars[first_slot + n]: slots[k] for n, k in enumerate(slot_order)}
  needed = {slots[k] for n, k in enumerate(slot_order) if used[first_slot + n]}
  return needed, _gathered(jaxpr, slot_vars)


def _gathered(jaxpr, derived: dict) -> set:
  """Values of `derived` (var -> label) that a gather in `jaxpr` reads, directly or through
  layout ops, inside higher-order ops too."""
  found, derived = set(), dict(derived)
  for eqn in jaxpr.eqns:
    first = eqn.invars[0] if eqn.invars else None
    label = derived.get(first) if isinstance(first, jex.Var) else None
    if label is not None and eqn.primitive.name == "gather":
      found.add(label)
    elif label is not None and eqn.primitive.name in LAYOUT_PRIMITIVES:
      derived.update((o, label) for o in eqn.outvars)
    for _, sub, atoms in sub_jaxprs(eqn):
      found |= _gathered(
        sub,
        {
          iv: derived[a]
          for a, iv in zip(atoms, sub.invars)
          if isinstance(a, jex.Var) and a in derived
        },
      )
  return found


def _spec(x):
  return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _cotangent_spec(x):
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return x
  return jax.ShapeDtypeStruct(x.shape, jax.dtypes.float0)


def zero_cotangent(x):
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, dtype=jax.dtypes.float0)


def is_real_cotangent(ct) -> bool:
  return ct is not None and getattr(ct, "dtype", None) != jax.dtypes.float0


def _last_readers(program, segments, views) -> dict[int, int]:
  """Value id -> last segment that reads it (len(segments) for the program's result)."""
  last = {}
  for seg in segments:
    for op in program.ops[seg.start : seg.end]:
      if not is_lazy_view(op, views):
        for a in op.inputs:
          if isinstance(a, int):
            last[a] = seg.id
  for o in program.output_ids:
    if isinstance(o, int):
      last[o] = len(segments)
  return last
