"""StepHooks.pipelines: the runner launches step N + 1 before reading step N only behind hooks
that say they allow it; a feature's hooks that do not say so keep the steps serial."""

from __future__ import annotations

from vllm.hisparse.worker import HiSparseWorker
from vllm.worker.gpu.step_hooks import StepHooks


def test_feature_hooks_pipeline_only_when_they_say_so():
    class Quiet(StepHooks):
        def before_forward(self, inp):
            pass

    class Declared(StepHooks):
        pipelines = True

    class Inherits(Declared):
        pass

    assert StepHooks.pipelines and StepHooks().pipelines  # the no-op hooks
    assert not Quiet.pipelines
    assert Declared.pipelines and not Inherits.pipelines  # each class declares its own
    assert HiSparseWorker.pipelines
