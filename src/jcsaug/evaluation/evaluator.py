"""Whole-case evaluation under every test-time method, as a MONAI evaluator.

* :class:`EvaluationCases`: a MONAI ``Dataset`` of datalist entries, each loaded by its transform; an entry that
  cannot be loaded comes back as its error, so one broken file is recorded instead of ending the evaluation.
* :class:`CaseEvaluator`: a ``monai.engines.SupervisedEvaluator`` whose iteration is one case predicted by every
  test-time method (``none``, ``heuristic``, ``learned``, ...; a blend's members once) and scored (Dice,
  sensitivity, precision, HD95; :func:`~jcsaug.evaluation.segmentation.score_case`). Its ``network`` is the
  evaluated network, so MONAI FL's ``MonaiAlgo`` (which takes only a ``SupervisedEvaluator``) loads the server's
  weights into it.
* :class:`MethodMeanDice`: an Ignite metric, one method's mean Dice over the cases. The evaluator's key metric
  (``key_val_metric``, default: its first method's) and one per other method put ``<method>_mean_dice`` into
  ``engine.state.metrics``, where MONAI's ``StatsHandler``, MONAI FL and any handler of the user's find it; the key
  one also gives ``engine.state.best_metric`` (what MONAI's ``CheckpointSaver(save_key_metric=True)`` reads).
* :class:`CaseMetrics`: an Ignite handler (``attach``) that gathers the scored cases and, when the evaluation ends,
  writes ``metrics.json`` and ``per_case.csv``.

:func:`evaluate_cases` builds and runs the three: what the bundles' ``train.yaml`` calls after training, and the
Python API. ``evaluate.yaml`` configures them at MONAI's ids (``validate#evaluator``, ``validate#dataset``, ...), so
``ConfigWorkflow(workflow_type="eval")`` runs it and its handlers can be overridden like any bundle's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine, Events
from ignite.handlers import ProgressBar
from ignite.metrics import Metric
from monai.data import DataLoader, Dataset
from monai.engines import SupervisedEvaluator
from monai.inferers import Inferer

from jcsaug.data.checks import describe_error
from jcsaug.data.roi import ROI_KEY
from jcsaug.evaluation.class_maps import check_postprocessing, describe_postprocessing
from jcsaug.evaluation.metrics import ComponentClasses, component_classes, nanmean
from jcsaug.evaluation.segmentation import (
    check_extra_names,
    report_subsets,
    score_case,
    summarize_methods,
    write_metrics,
)
from jcsaug.utils import as_flag

__all__ = [
    "CaseEvaluator",
    "CaseMetrics",
    "EvaluationCases",
    "MethodMeanDice",
    "evaluate_cases",
    "method_mean_dice",
    "one_case",
]

#: suffix of each method's mean Dice in ``engine.state.metrics`` (``learned_mean_dice``, ...)
MEAN_DICE_METRIC = "_mean_dice"


def case_name(entry: Any, index: int, image_key: str = "image") -> str:
    """How a case is named in the metrics: its image (a path, for the bundles' datalists), else its position."""
    return str(entry.get(image_key, f"case_{index}")) if isinstance(entry, Mapping) else f"case_{index}"


class EvaluationCases(Dataset):
    """The cases to evaluate: ``{"case", "entry", "data"}`` per datalist entry, ``data`` being the entry loaded by
    ``transform`` (e.g. the bundles' ``load``), or ``{"case", "entry", "error"}`` when loading fails (the error
    described, the file named), so :class:`CaseEvaluator` records it and goes on with the other cases."""

    def __init__(self, data: Sequence, transform: Callable[[Any], Mapping], image_key: str = "image") -> None:
        super().__init__(data=data, transform=transform)
        self.image_key = image_key

    def _transform(self, index: int) -> dict:
        entry = self.data[index]
        case = case_name(entry, index, self.image_key)
        try:
            # the transform called as it is, not through MONAI's apply_transform, whose wrapping error would
            # bury the reason (a missing file, a bad header) under "applying transform ..."
            return {"case": case, "entry": entry, "data": self.transform(entry)}
        except Exception as err:  # noqa: BLE001 - recorded with its reason; the other cases go on
            return {"case": case, "entry": entry, "error": describe_error(err)}


def one_case(batch: Sequence[dict]) -> dict:
    """``collate_fn`` of the evaluation's DataLoader (``batch_size=1``): the case as it is, not collated (its
    volumes differ in size, and an error entry holds no tensors)."""
    if len(batch) != 1:
        raise ValueError(f"the evaluation reads one case per iteration (batch_size=1), got {len(batch)}")
    return batch[0]


class MethodMeanDice(Metric):
    """The mean Dice of one test-time method over the cases a :class:`CaseEvaluator` scored (the cases that failed
    left out): the ``mean_dice`` of that method in ``metrics.json``, as an Ignite metric, so MONAI's key-metric
    machinery (``key_val_metric``: ``state.best_metric``, ``CheckpointSaver(save_key_metric=True)``) and any metric
    handler can use it. :func:`method_mean_dice` names it ``<method>_mean_dice``."""

    required_output_keys = None  # the output is the evaluator's case dict, read by _method_row

    def __init__(self, method: str, device: str | torch.device = "cpu") -> None:
        self.method = str(method)
        super().__init__(output_transform=self._method_row, device=device)

    def _method_row(self, output: Any) -> tuple:
        """The method's row of a scored case (a 1-tuple, as Ignite passes outputs on), None for a failed case."""
        rows = output.get("rows") if isinstance(output, Mapping) else None
        if rows is None:
            return (None,)
        if self.method not in rows:
            raise KeyError(f"MethodMeanDice({self.method!r}): the evaluator scored the methods {list(rows)}")
        return (rows[self.method],)

    def reset(self) -> None:
        self._dice: list[float] = []

    def update(self, output: tuple) -> None:
        if output[0] is not None:
            self._dice.append(float(output[0]["mean_dice"]))

    def compute(self) -> float:
        return nanmean(self._dice)


def method_mean_dice(method: str) -> dict[str, MethodMeanDice]:
    """``{"<method>_mean_dice": MethodMeanDice(method)}``: a :class:`CaseEvaluator`'s ``key_val_metric`` (or entry
    of ``additional_metrics``) for ``method``."""
    return {f"{method}{MEAN_DICE_METRIC}": MethodMeanDice(method)}


class CaseEvaluator(SupervisedEvaluator):
    """Every case of ``val_data_loader`` (from :class:`EvaluationCases`, collated by :func:`one_case`) predicted by
    every inferer of ``inferers`` and scored; ``engine.state.output`` is ``{"case", "rows": {method: row},
    "spacing_unknown"}`` or, for a case that could not be loaded or segmented, ``{"case", "error"}`` (with a
    warning). Attach :class:`CaseMetrics` to gather them. (The ``SupervisedEvaluator``'s single ``inferer`` is
    not used: the methods are ``inferers``.) Every method's mean Dice is in ``state.metrics`` after a run, as
    ``<method>_mean_dice`` (:class:`MethodMeanDice`).

    Args:
        device: where the network predicts (it is moved there).
        val_data_loader: the cases (see above).
        network: the trained network (in eval mode while predicting, without gradients).
        inferers: method name -> inferer, e.g. ``jcsaug.inference.make_tta_inferers(...)``.
        num_classes: classes including background.
        keep_largest_component: keep only the largest connected component of the predicted classes it names
            (False, True or foreground class ids; checked here, before any case is segmented).
        spacing: voxel size in mm for all cases; None: per case (``case_spacing``), else 1 mm with a warning.
        spacing_key: key of the data or datalist entry holding a case's spacing.
        image_key, label_key: keys of the loaded case.
        roi_key: where a loaded case holds its region of interest (predictions outside it are background).
        val_handlers: Ignite handlers to attach (e.g. :class:`CaseMetrics`, ``ProgressBar``, MONAI's
            ``StatsHandler``).
        mode: ``"eval"`` (default) or ``"train"``: the network's mode while predicting (MONAI's ``ForwardMode``).
        key_val_metric: MONAI's key metric (``state.key_metric_name``, ``state.best_metric``), e.g.
            ``method_mean_dice("learned")``; default: the first method's mean Dice.
        additional_metrics: more Ignite metrics of the cases' outputs; each method's mean Dice not given in
            either is added here.
        metric_cmp_fn: how MONAI compares two values of the key metric (default: higher is better).
        postprocessing: MONAI dictionary transforms that turn each method's output of a case into its class map
            before it is scored (:func:`~jcsaug.evaluation.class_maps.class_map`: ``{**loaded case, "pred":
            the method's C channels of logits}`` in, ``"pred"`` as class scores or one channel of class ids out),
            e.g. ``AsDiscreted("pred", argmax=True)`` then ``FillHolesd("pred")``; None: the argmax. The ROI mask
            and ``keep_largest_component`` follow it. (Not MONAI's batch-level postprocessing: a case here is
            predicted by several methods, each post-processed alone.)
    """

    def __init__(
        self,
        device: torch.device | str,
        val_data_loader: DataLoader,
        network: torch.nn.Module,
        inferers: Mapping[str, Inferer],
        num_classes: int,
        keep_largest_component: ComponentClasses = False,
        spacing: float | Sequence[float] | None = None,
        spacing_key: str | None = None,
        image_key: str = "image",
        label_key: str = "label",
        roi_key: str | None = ROI_KEY,
        val_handlers: Sequence | None = None,
        mode: str = "eval",
        key_val_metric: Mapping[str, Metric] | None = None,
        additional_metrics: Mapping[str, Metric] | None = None,
        metric_cmp_fn: Callable | None = None,
        postprocessing: Callable[[dict], Mapping] | None = None,
    ) -> None:
        self.case_postprocessing = check_postprocessing(postprocessing)
        # everything a handler reads when it is attached (at the end of Evaluator.__init__) is set first
        self.largest_component_classes = component_classes(keep_largest_component, num_classes)
        if not inferers:
            raise ValueError("no test-time methods to evaluate (inferers is empty)")
        if hasattr(val_data_loader, "__len__") and len(val_data_loader) == 0:
            raise ValueError("no cases to evaluate")
        self.network = network
        self.inferers = dict(inferers)
        self.num_classes = int(num_classes)
        self.spacing, self.spacing_key = spacing, spacing_key
        self.image_key, self.label_key, self.roi_key = image_key, label_key, roi_key
        key_val_metric, additional_metrics = self._every_mean_dice(key_val_metric, additional_metrics)
        comparison = {} if metric_cmp_fn is None else {"metric_cmp_fn": metric_cmp_fn}
        super().__init__(device=device, val_data_loader=val_data_loader, network=network, val_handlers=val_handlers,
                         mode=mode, decollate=False, key_val_metric=key_val_metric,
                         additional_metrics=additional_metrics, **comparison)  # fmt: skip
        self.add_event_handler(Events.STARTED, self._move_network)

    def _every_mean_dice(
        self, key: Mapping[str, Metric] | None, additional: Mapping[str, Metric] | None
    ) -> tuple[dict, dict]:
        """The key metric (default: the first method's mean Dice) and the additional metrics, completed with every
        method's mean Dice; a :class:`MethodMeanDice` of a method not evaluated is refused, naming the methods."""
        key = dict(method_mean_dice(self.methods[0]) if key is None else key)
        additional = dict(additional or {})
        for name, metric in {**key, **additional}.items():
            if isinstance(metric, MethodMeanDice) and metric.method not in self.inferers:
                raise ValueError(f"metric {name!r}: no test-time method {metric.method!r}; evaluated: {self.methods}")
        for method in self.methods:
            for name, metric in method_mean_dice(method).items():
                if name not in key and name not in additional:
                    additional[name] = metric
        return key, additional

    def _move_network(self, engine: Engine) -> None:
        """A network built on the CPU (a bundle's ``network_def``) follows the evaluation to its device."""
        self.network.to(engine.state.device)

    @property
    def methods(self) -> list[str]:
        """The test-time methods evaluated, in order."""
        return list(self.inferers)

    def _iteration(self, engine: Engine, batchdata: Mapping) -> dict:
        case = batchdata["case"]
        error = batchdata.get("error")
        if error is None:
            try:
                with self.mode(self.network), torch.no_grad():  # the mode is restored afterwards
                    rows, unknown = score_case(
                        self.network, batchdata["data"], batchdata["entry"], self.inferers, self.num_classes,
                        engine.state.device, case, image_key=self.image_key, label_key=self.label_key,
                        spacing=self.spacing, spacing_key=self.spacing_key, roi_key=self.roi_key,
                        largest_component_classes=self.largest_component_classes,
                        postprocessing=self.case_postprocessing,
                    )  # fmt: skip
                return {"case": case, "rows": rows, "spacing_unknown": unknown}
            except Exception as err:  # noqa: BLE001 - recorded with its reason; the other cases go on
                error = describe_error(err)
        warnings.warn(f"evaluation of case {case} failed: {error}", stacklevel=2)
        return {"case": case, "error": error}


class CaseMetrics:
    """Gathers a :class:`CaseEvaluator`'s cases; when its evaluation ends, builds every method's metrics
    (:attr:`metrics`, the dict :func:`evaluate_cases` returns) and writes them (``output_path``: ``metrics.json``;
    ``csv_path``: the per-case CSV, default ``per_case.csv`` beside it). Then, if cases failed and ``strict``,
    raises a ``ValueError`` naming each (after the files are written; ``strict=False``: only the warnings). (Each
    method's mean Dice in ``engine.state.metrics`` is the evaluator's, :class:`MethodMeanDice`.)

    Args:
        output_path: where to write ``metrics.json`` (atomically); None: nothing written.
        csv_path: where to write the per-case CSV.
        extra: more top-level entries of ``metrics.json`` (e.g. the bundles' ``policy_updates``).
        strict: raise when cases failed (see above).
        report_classes: named foreground class subsets whose mean Dice is given as ``mean_dice_reported``
            (checked when attached, before any case is segmented, as ``extra``'s names against the methods').
    """

    def __init__(
        self,
        output_path: str | Path | None = None,
        csv_path: str | Path | None = None,
        extra: Mapping | None = None,
        strict: bool = True,
        report_classes: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        self.output_path, self.csv_path = output_path, csv_path
        self.extra, self.strict, self.report_classes = extra, strict, report_classes
        self.metrics: dict = {}
        self._subsets: dict[str, list[int]] = {}
        self._reset()

    def attach(self, engine: CaseEvaluator) -> None:
        if not isinstance(engine, CaseEvaluator):
            raise TypeError(f"CaseMetrics gathers a CaseEvaluator's cases, not a {type(engine).__name__}'s")
        self._subsets = report_subsets(self.report_classes, engine.num_classes)
        if self.output_path is not None:  # as write_metrics will, but before any case is segmented
            check_extra_names(self.extra, engine.methods)
        engine.add_event_handler(Events.EPOCH_STARTED, self._reset)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._gather)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._finish)

    def _reset(self, engine: Engine | None = None) -> None:
        self._rows: dict[str, list[dict]] = {}
        self._failed: list[dict] = []
        self._unknown_spacing: list[str] = []
        self._cases = 0

    def _gather(self, engine: CaseEvaluator) -> None:
        output = engine.state.output
        self._cases += 1
        if "error" in output:
            self._failed.append({"case": output["case"], "error": output["error"]})
            return
        for method, row in output["rows"].items():
            self._rows.setdefault(method, []).append(row)
        if output.get("spacing_unknown"):
            self._unknown_spacing.append(output["case"])

    def _finish(self, engine: CaseEvaluator) -> None:
        if self._unknown_spacing:
            warnings.warn(
                f"voxel spacing unknown for {len(self._unknown_spacing)} case(s) (e.g. {self._unknown_spacing[0]}): "
                "HD95 computed with 1 mm voxels. Pass spacing= or spacing_key= to evaluate_cases.",
                stacklevel=2,
            )
        per_method = {method: self._rows.get(method, []) for method in engine.methods}
        self.metrics = summarize_methods(per_method, self._failed, engine.num_classes,
                                         engine.largest_component_classes, self._subsets,
                                         describe_postprocessing(engine.case_postprocessing))  # fmt: skip
        write_metrics(self.metrics, self.output_path, self.csv_path, self.extra)
        if self._failed and as_flag(self.strict):
            listed = "\n  ".join(f"{f['case']}: {f['error']}" for f in self._failed)
            where = f" (the other cases are in {self.output_path})" if self.output_path is not None else ""
            raise ValueError(f"evaluation failed for {len(self._failed)} of {self._cases} cases{where}:\n  {listed}")


def evaluate_cases(
    network: torch.nn.Module,
    cases: Sequence[Mapping],
    load: Callable[[Mapping], Mapping],
    inferers: Mapping[str, Inferer],
    num_classes: int,
    device: torch.device | str = "cpu",
    output_path: str | Path | None = None,
    image_key: str = "image",
    label_key: str = "label",
    progress: bool = True,
    spacing: float | Sequence[float] | None = None,
    spacing_key: str | None = None,
    keep_largest_component: ComponentClasses = False,
    csv_path: str | Path | None = None,
    extra: Mapping | None = None,
    strict: bool = True,
    report_classes: Mapping[str, Sequence[int]] | None = None,
    roi_key: str | None = ROI_KEY,
    num_workers: int = 0,
    key_method: str | None = None,
    postprocessing: Callable[[dict], Mapping] | None = None,
) -> dict:
    """Dice, sensitivity, precision and HD95 of every case under every inferer; returns the metrics dict.

    Runs a :class:`CaseEvaluator` over :class:`EvaluationCases` with :class:`CaseMetrics` (and a progress bar).

    Args:
        network: the trained network (moved to ``device``; in eval mode while predicting).
        cases: datalist entries (e.g. ``{"image": path, "label": path}``).
        load: transform turning an entry into tensors (``LoadImaged`` ... ``EnsureTyped``).
        inferers: method name -> inferer, e.g. ``{"none": NoTTAInferer(sw), "learned_tea": ...}``.
        num_classes: number of classes including background.
        output_path: where to write ``metrics.json`` (atomically); ``per_case.csv`` goes next to it.
        spacing: voxel size in mm for all cases; None = per case from :func:`case_spacing`, else 1 mm
            (with a warning).
        spacing_key: key of the data or datalist entry holding the spacing (see :func:`case_spacing`).
        keep_largest_component: keep only the largest connected component of the predicted classes it names:
            False, True (every foreground class) or foreground class ids, e.g. ``[1, 3]`` (also the string
            ``"[1, 3]"`` a command line passes; :func:`~jcsaug.evaluation.metrics.component_classes`). Checked
            before any case is segmented.
        csv_path: where to write the per-case CSV (default: ``per_case.csv`` next to ``output_path``).
        extra: more top-level entries of ``metrics.json`` besides the methods, e.g. the bundles'
            ``"policy_updates"`` (updates done and skipped per policy updater); not in the returned dict.
        strict: after writing the files, raise a ``ValueError`` naming every case that failed (to load or to be
            segmented); ``False``: only warn. Either way the failed cases are in ``failed_cases`` and the others
            are evaluated.
        report_classes: named foreground class subsets (a task's :attr:`~jcsaug.tasks.TaskSpec.report_classes`,
            e.g. ``{"tumour": [2]}`` for KiTS) whose mean Dice is given beside the all-class one, as
            ``"mean_dice_reported"``; computed as ``jcsaug report --classes`` does (per case over the subset, then
            over the cases), so the two agree.
        roi_key: where ``load`` gives a case's region of interest (:class:`jcsaug.data.ThresholdROId`): its
            predictions outside it are background (:func:`jcsaug.data.mask_outside_roi`), before the largest
            component is kept, as the reference code masks its test predictions. A case without it is predicted
            as it is; None: never masked.
        num_workers: DataLoader workers loading the next cases while one is predicted (0: in this process).
        key_method: the method whose mean Dice is the evaluator's key metric (the one MONAI logs as the best);
            default: the first of ``inferers``.
        postprocessing: MONAI dictionary transforms turning each method's prediction of a case into its class map
            before it is scored (see :class:`CaseEvaluator`); None: the argmax.

    Returns:
        ``{method: {"mean_dice", "mean_dice_per_class", "summary": {metric: {"mean", "per_class",
        "n_undefined", "n_undefined_per_class"}}, "empty_cases": {status: [count per class]},
        "per_case": [{"case", "dice", "mean_dice", "sensitivity", "precision", "hd95", "status",
        "spacing", "roi_masked"}], "failed_cases": [{"case", "error"}], "largest_component_classes": [the classes
        post-processed], "segmentation_postprocessing": its transforms named, or None}}`` (with ``report_classes`` also
        ``"mean_dice_reported": {name: {"classes", "mean_dice"}}``) — per-case metric values are lists over the
        foreground classes; means are over the cases that did not fail.
    """
    loader = DataLoader(EvaluationCases(cases, load, image_key), batch_size=1, num_workers=num_workers,
                        collate_fn=one_case)  # fmt: skip
    metrics = CaseMetrics(output_path, csv_path, extra=extra, strict=strict, report_classes=report_classes)
    handlers: list = [metrics]
    if progress:
        handlers.append(ProgressBar(desc="evaluate", persist=True))
    evaluator = CaseEvaluator(
        device, loader, network, inferers, num_classes, keep_largest_component=keep_largest_component,
        spacing=spacing, spacing_key=spacing_key, image_key=image_key, label_key=label_key, roi_key=roi_key,
        val_handlers=handlers, key_val_metric=None if key_method is None else method_mean_dice(key_method),
        postprocessing=postprocessing,
    )  # fmt: skip
    evaluator.run()
    return metrics.metrics
