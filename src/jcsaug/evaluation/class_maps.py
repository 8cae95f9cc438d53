"""A method's prediction of a case turned into its class map, with the user's MONAI post-processing if any: what the
evaluation scores (:func:`~jcsaug.evaluation.segmentation.score_case`), the largest-component choice reads and the
inference saves (:class:`~jcsaug.inference.LogitsToSegmentationd`), so the three agree."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from monai.data import MetaTensor

__all__ = ["check_postprocessing", "class_map", "describe_postprocessing"]


def check_postprocessing(postprocessing: object) -> Callable[[dict], Mapping] | None:
    """``postprocessing`` itself if it is None or callable (MONAI transforms), else a ``TypeError`` naming its type:
    what :class:`~jcsaug.evaluation.CaseEvaluator` and :class:`~jcsaug.inference.LogitsToSegmentationd` accept."""
    if postprocessing is not None and not callable(postprocessing):
        raise TypeError(f"postprocessing must be callable (MONAI transforms), not {type(postprocessing).__name__}")
    return postprocessing


def class_map(
    output: torch.Tensor,
    num_classes: int,
    postprocessing: Callable[[dict], Mapping] | None = None,
    data: Mapping | None = None,
    what: str = "the prediction",
    pred_key: str = "pred",
    image_key: str = "image",
) -> torch.Tensor:
    """One method's class map of a case (``[*spatial]``, ``long``, on the CPU) from its output (``[1, C,
    *spatial]`` logits or log-probabilities): the argmax over the classes or, with ``postprocessing`` (MONAI
    dictionary transforms, e.g. ``Compose([AsDiscreted("pred", argmax=True), FillHolesd("pred")])``), what they make
    of ``{**data, pred_key: the output's C channels}``: the case's loaded keys beside the prediction, as a MONAI
    evaluator's postprocessing sees a batch and its output (the prediction a ``MetaTensor`` with the image's meta
    data where the image has them). They return ``pred_key`` as ``C`` channels of class scores (then argmaxed) or one
    channel of class ids; a result of another shape, or values that are not class ids in ``[0, num_classes)``, is
    refused naming ``what`` (e.g. ``"method 'learned'"``)."""
    if postprocessing is None:
        return output.argmax(1)[0].cpu()
    pred = output[0].clone()  # a blend's member output is kept for the blend: never handed out to be changed
    image = (data or {}).get(image_key)
    if isinstance(image, MetaTensor) and not isinstance(pred, MetaTensor):
        pred = MetaTensor(pred, meta=dict(image.meta))
    result = postprocessing({**(data or {}), pred_key: pred})
    if not isinstance(result, Mapping) or pred_key not in result:
        raise ValueError(f"the postprocessing of {what} must return a dict holding {pred_key!r}, "
                         f"not a {type(result).__name__}" + ("" if not isinstance(result, Mapping) else
                         f" without it (keys {sorted(map(str, result))})"))  # fmt: skip
    post = torch.as_tensor(result[pred_key]).detach().cpu()
    spatial = tuple(output.shape[2:])
    if post.ndim != len(spatial) + 1 or tuple(post.shape[1:]) != spatial or post.shape[0] not in (1, num_classes):
        raise ValueError(f"the postprocessing of {what} returned {pred_key!r} of shape "
                         f"{tuple(post.shape)}; expected {(num_classes, *spatial)} class scores or {(1, *spatial)} "
                         "class ids")  # fmt: skip
    if post.shape[0] == num_classes and num_classes > 1:
        if post.is_floating_point() and not bool(torch.isfinite(post).all()):
            raise ValueError(f"the postprocessing of {what} returned {pred_key!r} class scores that are not all finite "
                             f"({int((~torch.isfinite(post)).sum())} NaN or infinite values)")  # fmt: skip
        return post.argmax(0)
    ids = post[0].round().long()
    if not torch.equal(ids.to(post.dtype), post[0]) or int(ids.min()) < 0 or int(ids.max()) >= num_classes:
        raise ValueError(f"the postprocessing of {what} returned {pred_key!r} values that are not class "
                         f"ids 0..{num_classes - 1} (from {float(post.min()):g} to {float(post.max()):g})")  # fmt: skip
    return ids


def describe_postprocessing(postprocessing: Callable | None) -> str | None:
    """How ``metrics.json`` and the run summary name a postprocessing: a MONAI ``Compose``'s transforms by class, in
    order (nested ones flattened), e.g. ``"AsDiscreted, FillHolesd"``; another callable by its name; None: None."""
    if postprocessing is None:
        return None
    flatten = getattr(postprocessing, "flatten", None)
    steps = list(flatten().transforms) if callable(flatten) else [postprocessing]
    return ", ".join(getattr(step, "__name__", None) or type(step).__name__ for step in steps)
