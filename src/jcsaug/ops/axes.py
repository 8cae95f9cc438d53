"""The one place where anatomical axis names are tied to array axes.

Volumes are channel-first ``[C, X, Y, Z]`` after ``monai.transforms.Orientationd(axcodes="RAS")``:

* sagittal axis = array axis 0 (left-right); the *sagittal plane* is normal to it;
* frontal axis = array axis 1 (posterior-anterior); the *frontal (coronal) plane* is normal to it;
* longitudinal axis = array axis 2 (inferior-superior); the *axial plane* is normal to it.

"Rotate about the frontal axis" rotates inside the plane spanned by the two other axes; "mirror in
the sagittal plane" flips array axis 0.
"""

from __future__ import annotations

SAGITTAL = 0
FRONTAL = 1
LONGITUDINAL = 2

AXIS_NAMES = {SAGITTAL: "sagittal", FRONTAL: "frontal", LONGITUDINAL: "longitudinal"}


def rotation_plane(axis: int) -> tuple[int, int]:
    """Spatial axes of the plane a rotation about ``axis`` acts in (0-based spatial indices)."""
    if axis not in AXIS_NAMES:
        raise ValueError(f"spatial axis must be 0, 1 or 2, got {axis!r}")
    a, b = (i for i in range(3) if i != axis)
    return a, b
