"""jcsaug: learned class-specific training- and test-time augmentation for 3D segmentation (MONAI-native).

Sub-packages (imports point down only): ``ops`` (operation catalogues) <- ``policy`` (learnable
categorical policies and MONAI dictionary transforms) <- ``engine`` / ``inference``.
"""

__version__ = "0.1.0"
