"""The offloaded optimizer step, streamed sub-group by sub-group (DeepSpeed's
`sub_group_size` under ZeRO-Offload): each sub-group's fp32 masters and optimizer state move
from host memory to the device, are updated there and move back, so the device holds about
two sub-groups' state at a time instead of all of it. Group g's transfer to the device is
ordered after group g-2's update, so it overlaps group g-1's update.

optax sees whole trees, not sub-groups. Each group therefore runs the optimizer's update on
the whole tree with that group's real leaves and placeholders elsewhere, and keeps only the
group's results: XLA drops the placeholders' dead work. That is exact only if each
parameter's new master and state depend on nothing but the gradients, that parameter's own
master and state, and the state shared by all (counts, schedules); `separable` checks this on
the update's jaxpr, and where it fails (an optimizer mixing leaves' state) the step moves the
whole state at once, as before streaming, with a warning that names the leaf.
"""

import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.tree_util import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from zjax._src.schedule import ir, report
from zjax._src.train import offload

ANY, SHARED = "any", "shared"  # input classes: gradients / finite, state shared by all groups


def state_owners(opt_state, storage) -> list:
  """For each leaf of an optax state, the storage leaf (flat index) it is the per-parameter
  copy of: its key path ends with that leaf's path and it has that leaf's shape; None for
  state shared by all parameters (step counts, schedule state)."""
  leaves = tree_flatten_with_path(storage)[0]
  by_path = {tuple(path): (i, x.shape) for i, (path, x) in enumerate(leaves)}
  owners = []
  for path, x in tree_flatten_with_path(opt_state)[0]:
    path, owner = tuple(path), None
    for start in range(len(path)):  # the longest suffix that is a parameter's path
      found = by_path.get(path[start:])
      if found is not None and found[1] == x.shape:
        owner = found[0]
        break
    owners.append(owner)
  return owners


def dependencies(jaxpr, ordering: bool = False) -> list[frozenset]:
  """For each output of `jaxpr`, the indices of the inputs its value depends on (through
  calls such as pjit and custom derivatives; other higher-order primitives: on all their
  inputs). An optimization barrier passes each value through unchanged; with `ordering`
  its outputs depend on all its inputs (what it orders them after)."""
  read = dependency_reader(jaxpr, ordering)
  return [read(v) for v in jaxpr.outvars]


def dependency_reader(jaxpr, ordering: bool = False):
  """var -> the indices of `jaxpr`'s inputs that var (any var of its top level) depends on
  (`ordering`: as in `dependencies`)."""
  env = {v: frozenset([i]) for i, v in enumerate(jaxpr.invars)}
  read = lambda v: frozenset() if isinstance(v, jcore.Literal) else env.get(v, frozenset())  # noqa: E731
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    inner = _called_jaxpr(eqn)
    if eqn.primitive.name == "optimization_barrier" and not ordering:
      outs = ins
    elif inner is not None:
      outs = [frozenset().union(*(ins[j] for j in d)) for d in dependencies(inner, ordering)]
    else:
      outs = [frozenset().union(*ins)] * len(eqn.outvars)
    env.update(zip(eqn.outvars, outs))
  return read


def _called_jaxpr(eqn):
  """The jaxpr a call-like equation runs on exactly its operands, else None."""
  for name in ("jaxpr", "call_jaxpr"):
    inner = eqn.params.get(name)
    inner = getattr(inner, "jaxpr", inner)  # ClosedJaxpr -> Jaxpr
    if (
      isinstance(inner, jcore.Jaxpr)
      and len(inner.invars) == len(eqn.invars)
      and len(inner.outvars) == len(eqn.outvars)
    ):
      return inner
  return None


def separable(update, grads, opt_state, masters, finite, state_group, master_group):
  """None if each group's new masters and state depend only on the gradients, `finite`, the
  shared state and the group's own leaves; else a sentence naming the first leaf that
  does not."""
  abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
  jaxpr = jax.make_jaxpr(update)(*map(abstract, (grads, opt_state, masters, finite))).jaxpr
  n_grads = len(jax.tree.leaves(grads))
  classes = (
    [ANY] * n_grads + [SHARED if g is None else g for g in state_group] + list(master_group) + [ANY]
  )
  out_groups = list(master_group) + [SHARED if g is None else g for g in state_group]
  names = [f"master {p}" for p in _paths(masters)] + [
    f"optimizer state {p}" for p in _paths(opt_state)
  ]
  for name, group, deps in zip(names, out_groups, dependencies(jaxpr)):
    if group is None:  # an untrained parameter's master: not updated, not streamed
      continue
    allowed = {ANY, SHARED, group}
    foreign = [i for i in deps if classes[i] not in allowed]
    if foreign:
      return (
        f"the new {name} depends on another sub-group's leaf (input {foreign[0]} of the update)"
      )
  return None


def _paths(tree):
  return [keystr(path) for path, _ in tree_flatten_with_path(tree)[0]]


def streamed_update(
  update, grads, opt_state, masters, copies, groups, finite, copy_dtypes, copies_kind=offload.DEVICE
):
  """(new masters on the host, new optimizer state on the host, new parameter copies in
  `copies_kind` memory (offload_params: the host)): the offloaded update, sub-group by
  sub-group. `update(grads, opt_state, masters, finite, groups)` is the whole-tree update
  applying the additions of `groups` (default: all); `copies` the parameter copies
  (compute dtype) of `masters`."""
  m_leaves, m_def = tree_flatten(masters)
  o_leaves, o_def = tree_flatten(opt_state)
  c_leaves = jax.tree.leaves(copies)
  group_of = {i: g for g, group in enumerate(groups) for i in group}
  master_group = [group_of.get(i) for i in range(len(m_leaves))]
  owners = state_owners(opt_state, masters)
  state_group = [None if o is None else group_of.get(o) for o in owners]
  if len(groups) <= 1:
    return _whole_update(update, grads, opt_state, masters, finite, copy_dtypes, copies_kind)
  reason = separable(update, grads, opt_state, masters, finite, state_group, master_group)
  if reason is not None:
    warnings.warn(
      f"offload_optimizer: the optimizer step moves the whole state at once, "
      f"not sub-group by sub-group: {reason}.",
      stacklevel=2,
    )
    return _whole_update(update, grads, opt_state, masters, finite, copy_dtypes, copies_kind)

  shared = [j for j, g in enumerate(state_group) if g is None]
  shared_dev = offload.to_space([o_leaves[j] for j in shared], "device")
  # placeholders (device, right shape, sharding and dtype; made from the gradients, which
  # are on the device: nothing moves for them); their work is dead code
  m_in = [g.astype(m.dtype) for g, m in zip(jax.tree.leaves(grads), m_leaves)]
  o_in = [None] * len(o_leaves)
  for j, shared_leaf in zip(shared, shared_dev):
    o_in[j] = shared_leaf
  for j, owner in enumerate(owners):
    if o_in[j] is None:
      o_in[j] = m_in[owner].astype(o_leaves[j].dtype)
  new_m, new_o, new_c = list(m_leaves), [None] * len(o_leaves), list(c_leaves)
  done = []  # each group's device results, for ordering the transfers
  for g, group in enumerate(groups):
    mine = [j for j, grp in enumerate(state_group) if grp == g]
    host = ([m_leaves[i] for i in group], [o_leaves[j] for j in mine])
    if g >= 2:  # moved in after group g-2 is updated: at most two groups on the device
      host, _ = lax.optimization_barrier((host, done[g - 2]))
    dev_m, dev_o = offload.to_space(host, "device")
    m_call, o_call = list(m_in), list(o_in)
    for i, x in zip(group, dev_m):
      m_call[i] = x
    for j, x in zip(mine, dev_o):
      o_call[j] = x
    out_m, out_o = update(
      grads, tree_unflatten(o_def, o_call), tree_unflatten(m_def, m_call), finite, [group]
    )
    out_m, out_o = tree_flatten(out_m)[0], tree_flatten(out_o)[0]
    results = ([out_m[i] for i in group], [out_o[j] for j in mine])
    done.append(results)
    new_copies = [x.astype(copy_dtypes[i]) for i, x in zip(group, results[0])]
    if copies_kind == offload.HOST:
      new_copies = offload.to_space(new_copies, "host")
    for i, x in zip(group, new_copies):
      new_c[i] = x
    back_m, back_o = offload.to_space(results, "host")
    for i, x in zip(group, back_m):
      new_m[i] = x
    for j, x in zip(mine, back_o):
      new_o[j] = x
    if g == 0:  # the shared state's new value (every group computes the same)
      for j, x in zip(shared, offload.to_space([out_o[j] for j in shared], "host")):
        new_o[j] = x
  return (tree_unflatten(m_def, new_m), tree_unflatten(o_def, new_o), tree_unflatten(m_def, new_c))


def _whole_update(update, grads, opt_state, masters, finite, copy_dtypes, copies_kind):
  new_m, new_o = update(
    grads, offload.to_space(opt_state, "device"), offload.to_space(masters, "device"), finite
  )
  copies = offload.device_copies(new_m, copy_dtypes)
  if copies_kind == offload.HOST:
    copies = offload.to_space(copies, "host")
  new_m, new_o = offload.to_space((new_m, new_o), "host")
  return new_m, new_o, copies


def predicted(schedule, groups, state_factor: int = 2, params_on_host: bool = False) -> dict:
  """The offloaded step's bytes per device, from the schedule: the parameter copies
  (compute dtype; on the device, or with `params_on_host` (offload_params) on the host),
  the host's masters and optimizer state (`state_factor` fp32 values per trained parameter:
  adam's two moments), and the most optimizer state the stream holds on the device at once
  (two consecutive sub-groups' masters + state); with `params_on_host`, the bytes the
  gathers bring from the host per step (`param_transfer_bytes`)."""
  n, compute = schedule.num_devices, schedule.config.compute_dtype
  local = [ir.local_elements(leaf.entry, n) for leaf in schedule.storage]
  dtypes = [jnp.dtype(leaf.entry.dtype) for leaf in schedule.storage]
  group_bytes = [sum(local[i] for i in group) * 4 * (1 + state_factor) for group in groups]
  pairs = [a + b for a, b in zip(group_bytes, group_bytes[1:])] or group_bytes or [0]
  trained = sum(local[i] for group in groups for i in group)
  copies = sum(e * ir.gather_dtype(d, compute).itemsize for e, d in zip(local, dtypes))
  host = sum(e * d.itemsize for e, d in zip(local, dtypes)) + trained * 4 * state_factor
  return {
    "device_bytes": 0 if params_on_host else copies,
    "host_bytes": host + (copies if params_on_host else 0),
    "params_on_host": params_on_host,
    "param_transfer_bytes": param_transfer_bytes(schedule) if params_on_host else 0,
    "sub_groups": len(groups),
    "stream_device_bytes": max(pairs),
    "whole_state_bytes": sum(group_bytes),
  }


def param_transfer_bytes(schedule) -> int:
  """Bytes per device that offload_params moves from the host to the device in one step:
  each executed gather's bucket shards (hpZ's backward gathers read the device's secondary
  shards instead) and, once, the persistent leaves; all in the compute dtype."""
  n, config = schedule.num_devices, schedule.config
  elements = schedule.bucket_elements()
  total = 0
  for phase, steps in (("forward", schedule.forward), ("backward", schedule.backward)):
    if phase == "backward" and config.secondary_partition:
      continue
    for st in report.executed_steps(steps):
      if st.op == "gather":
        dtype = ir.gather_dtype(schedule.buckets[st.bucket].dtype, config.compute_dtype)
        total += elements[st.bucket] // n * dtype.itemsize
  return total + sum(
    ir.local_elements(leaf.entry, n)
    * ir.gather_dtype(leaf.entry.dtype, config.compute_dtype).itemsize
    for leaf in schedule.storage
    if leaf.entry.persistent
  )
