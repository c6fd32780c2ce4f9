"""A decoded video frame's display matrix as the turn and mirror a player applies before showing it.

`display_orientation(frame)` reads the frame's DISPLAYMATRIX side data (a phone's portrait clip is stored
landscape with a matrix that turns it a quarter; a front camera's, or `ffmpeg -display_hflip`'s, also mirrors
it: `av_display_matrix_flip` negates the matrix's first column, its determinant goes negative) and returns the
`Orientation` that `apply` puts on the stored RGB frame, [H, W, 3] -> [H', W', 3] as shown (a view).

The decision is FFmpeg's autorotate, as `ffmpeg` (fftools/ffmpeg_filter.c) and `ffplay` insert it: the angle
`get_rotation` reads (`av_display_rotation_get`, whole degrees), then 90: `transpose=clock`, or `cclock_flip`
when mirrored (c > 0); 180: `hflip` when a < 0 and `vflip` when d < 0; 270: `transpose=cclock`, or
`clock_flip` when mirrored (c < 0); 0: `vflip` when d < 0 (a, b, c, d: the matrix's entries 0, 1, 3, 4). Any
other angle (FFmpeg's `rotate` filter) and a singular matrix are not applied: those frames stay as stored.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import av

MATRIX_BYTES = 36
"""AV_FRAME_DATA_DISPLAYMATRIX: nine native-endian int32 (16.16 fixed point; the last column 2.30)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Orientation:
    """How a stored frame becomes the shown one: transposed first, then its rows and columns reversed."""

    transpose: bool = False
    """Rows become columns (a quarter turn, with one of the flips below)."""
    flip_rows: bool = False
    """Top and bottom swapped (FFmpeg's `vflip`), after the transpose."""
    flip_columns: bool = False
    """Left and right swapped (FFmpeg's `hflip`), after the transpose."""

    def apply(self, frame: np.ndarray) -> np.ndarray:
        """[H, W, C] as stored -> [H', W', C] as shown (a view of `frame`)."""
        shown = frame.swapaxes(0, 1) if self.transpose else frame  # [W, H, C] when transposed
        return shown[:: -1 if self.flip_rows else 1, :: -1 if self.flip_columns else 1]

    def shown_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of a stored `height` x `width` frame once shown."""
        return (width, height) if self.transpose else (height, width)


UPRIGHT = Orientation()
"""No display matrix, or one that is the identity (or an angle FFmpeg does not turn in quarters)."""


def display_orientation(frame: av.VideoFrame) -> Orientation:
    """The Orientation that shows `frame` as FFmpeg's players do (its DISPLAYMATRIX side data; UPRIGHT
    without one)."""
    for side_data in getattr(frame, "side_data", ()):
        if getattr(side_data.type, "name", None) == "DISPLAYMATRIX":
            raw = bytes(side_data)
            if len(raw) == MATRIX_BYTES:
                return matrix_orientation(struct.unpack("=9i", raw))
    return UPRIGHT


def matrix_orientation(matrix: tuple[int, ...]) -> Orientation:
    """FFmpeg's autorotate choice (module docstring) for a display matrix of nine ints."""
    a, b, c, d = matrix[0], matrix[1], matrix[3], matrix[4]
    theta = _get_rotation(a, b, c, d)
    if math.isnan(theta):
        return UPRIGHT
    if abs(theta - 90) < 1:
        # transpose=cclock_flip (a plain transpose) for the mirrored matrix, else transpose=clock
        return Orientation(transpose=True, flip_columns=not c > 0)
    if abs(theta - 180) < 1:
        return Orientation(flip_rows=d < 0, flip_columns=a < 0)
    if abs(theta - 270) < 1:
        # transpose=clock_flip for the mirrored matrix, else transpose=cclock
        return Orientation(transpose=True, flip_rows=True, flip_columns=c < 0)
    if abs(theta) < 1:
        return Orientation(flip_rows=d < 0)
    return UPRIGHT


def _get_rotation(a: int, b: int, c: int, d: int) -> float:
    """fftools' get_rotation: the clockwise turn in whole degrees, in [-0.9, 359.1) (NaN: singular)."""
    scale_x, scale_y = math.hypot(a, c), math.hypot(b, d)
    if scale_x == 0 or scale_y == 0:
        return math.nan
    # av_display_rotation_get: counterclockwise degrees; C's round() takes halves away from zero
    counterclockwise = -math.degrees(math.atan2(b / scale_y, a / scale_x))
    theta = -math.copysign(math.floor(abs(counterclockwise) + 0.5), counterclockwise)
    return theta - 360 * math.floor(theta / 360 + 0.9 / 360)
