"""What several test files share: planning, compiling and costing with the warnings quiet, a
training loop of a parallel module beside the single-device model, and the check that a
``verify`` run computed what one device computes.

Test files import it as ``helpers``: pytest puts tests/ (conftest.py's folder) on
``sys.path``, and the ranks ``run_local`` starts take the caller's path.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import autopar


@contextlib.contextmanager
def quiet(category: type[Warning] = Warning) -> Iterator[None]:
    """Warnings of ``category`` (every warning, by default) ignored inside the block.

    NOTE: a zoo model replicates the ops it has no rule for (NoRuleWarning, which
    pyproject.toml turns into an error); the tests that plan one do not test the rules."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category)
        yield


def plan_quietly(*args, **kwargs) -> autopar.Plan:
    """``autopar.plan(*args, **kwargs)`` with its warnings ignored."""
    with quiet():
        return autopar.plan(*args, **kwargs)


def compile_quietly(*args, **kwargs):
    """``autopar.compile(*args, **kwargs)`` with its warnings ignored."""
    with quiet():
        return autopar.compile(*args, **kwargs)


def evaluate_quietly(*args, **kwargs) -> autopar.Plan:
    """``autopar.evaluate(*args, **kwargs)`` with its warnings ignored."""
    with quiet():
        return autopar.evaluate(*args, **kwargs)


def train_beside(
    pm,
    local: tuple,
    opt,
    ref_loss: Callable[[], object],
    ref_opt,
    steps: int,
    *,
    first_step=None,
) -> Iterator[tuple[float, float]]:
    """Train the parallel module ``pm`` on its local batch and the single-device model beside
    it, ``steps`` steps, each with its optimizer; ``ref_loss()`` is the single-device model's
    loss on the whole batch. Yields each step's ``(loss, ref_loss)`` after both backwards and
    before both optimizers step, so the loop's body reads (or clips) the gradients of that
    step. ``first_step``: a context the first step's parallel forward and backward run in
    (a ``CollectiveBytes`` counting them)."""
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        with first_step if step == 0 and first_step is not None else contextlib.nullcontext():
            loss = pm(*local)
            loss.backward()
        want = ref_loss()
        want.backward()
        yield loss.item(), want.item()
        opt.step()
        ref_opt.step()


def assert_matches_one_device(reports, rel: float) -> None:
    """Every rank's losses, gradients and parameters in ``verify``'s reports are the
    single-device model's within ``rel``, and every op ran with its planned placement."""
    for r in reports:
        for got, want in zip(r.losses, r.ref_losses):
            assert abs(got - want) <= rel * abs(want), (r.losses, r.ref_losses)
        assert r.grad_rel_err <= rel, (r.grad_rel_err, r.worst_grad)
        assert r.param_rel_err <= rel, (r.param_rel_err, r.worst_param)
        assert not r.mismatches, r.mismatches


def staged_plan(
    model, mesh, example_inputs, *, loss_fn, example_targets, fresh=False, **options
) -> tuple[autopar.Plan, object]:
    """``autopar.plan`` with its pipeline state (passes/pipeline ``State``): the plan and the
    state its stages left. ``options``: ``autopar.plan``'s keywords. ``fresh``: the report
    stages (the emitted step's: order, buckets, prefetch, memory) ask a new emitter
    (passes/emit), which judged no overlap round, so each makes its artifact anew instead of
    taking what the rounds made of the solution."""
    from autopar import api
    from autopar.passes.emit import Emitter

    mp = options.pop("mp_policy", None)
    with contextlib.ExitStack() as stack, quiet():
        step = api._trace(model, example_inputs, loss_fn, example_targets, stack, {}, mp=mp)
        opts = api.plan_options(**options)
        state = api.searched(step, mesh, opts)
        if fresh:
            judged = state.emitter
            assert judged is not None
            state.emitter = Emitter(
                judged.space, judged.gm, skip=judged.skip, bucket_bytes=judged.bucket_bytes,
                optimizer=judged.optimizer,
            )  # fmt: skip
        return api.reported(state), state
