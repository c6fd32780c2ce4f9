"""Still images: decode an uploaded conditioning image, cover-resize + centre-crop it, encode PNG output.

Inputs are raw bytes (an `input_reference` upload) or uint8 RGB arrays; outputs are uint8 (H, W, 3) arrays
or PNG bytes. Decoding and PNG use Pillow only, so the API process can validate uploads without torch.

`resize_center_crop` reproduces what diffusers 0.42.1's Cosmos3 pipeline does to an I2V image
(`_preprocess_conditioning_image`, cosmos3-model.md §5.3 step 1): scale to cover the target
(`scale = max(W/w, H/h)`, sizes `ceil(scale*w)`, `ceil(scale*h)`), antialiased bilinear resize on float32,
`round()` crop offsets, then round and clamp to uint8. The resize is torch's own CPU kernel
(`F.interpolate(..., antialias=True)`), imported lazily: the oracle's float results depend on which ATen
loop runs (FMA contraction differs with the tap count), so calling that kernel is the only way to be equal
to it on every machine, and it is several times faster than a numpy port. The backend (which has torch)
calls it when it prepares an I2V request.
"""

from __future__ import annotations

import io
import math
import re
import warnings

import numpy as np
from PIL import Image, ImageOps

from worldserve.params import ParamError

INVALID_REFERENCE_MESSAGE = "Invalid input_reference: provided content is not a valid image or video."


def invalid_reference(param: str) -> str:
    """vLLM-Omni's message for undecodable reference media, naming the field it came in (input_reference,
    image_reference, a chat's image_url, ...)."""
    return INVALID_REFERENCE_MESSAGE.replace("input_reference", param, 1)


class ImageTooLarge(ParamError):
    """An image Pillow recognises but refuses to decode: more pixels than `max_pixels()` (a decompression
    bomb guard). Not "some other format": callers that sniff image-then-video must not retry it as video."""


def max_pixels() -> int:
    """Pixels an image (or a video frame) may have: Pillow's decompression-bomb limit (~89.5 M)."""
    return int(Image.MAX_IMAGE_PIXELS or 2**31)


def too_large(param: str, pixels: int | None, what: str = "the image") -> ImageTooLarge:
    size = "" if pixels is None else f" ({pixels:,} pixels)"
    return ImageTooLarge(
        param, f"{param}: {what}{size} is above this server's limit of {max_pixels():,} pixels"
    )


def image_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from an image file's header, nothing decoded; None when Pillow cannot tell (decode_image
    then says what is wrong)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                return img.height, img.width
    except Exception:  # (any failure of Pillow's header parsers on untrusted bytes: decode_image reports it)
        return None


def decode_image(
    data: bytes, *, param: str = "input_reference", rgba_background: tuple[int, int, int] | None = None
) -> np.ndarray:
    """Decode image bytes (any Pillow format) to uint8 RGB (H, W, 3), applying the EXIF orientation.

    16-bit grayscale is scaled to 8 bits (where `convert("RGB")` clips it at 255). Alpha is dropped as
    `Image.convert("RGB")` does (the diffusers pipeline converts the same way); with
    `rgba_background`, an image with transparency is composited over that colour instead (vLLM's
    `rgba_to_rgb`, white by default there, for chat images: a transparent pixel is the background, not its
    hidden colour; vLLM does it for RGBA only, transformers' processors for LA and palette transparency too,
    as here).
    Raises ImageTooLarge(param, ...) for an image above `max_pixels()` (checked from its header, before
    decoding), ParamError(param, ...) for anything Pillow cannot decode and for truncated files.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as opened:
                if opened.width * opened.height > max_pixels():
                    raise too_large(
                        param, opened.width * opened.height, f"the image of {opened.width}x{opened.height}"
                    )
                opened.load()
                ImageOps.exif_transpose(opened, in_place=True)  # (returning a copy costs ~10 ms at 720p)
                img: Image.Image = opened
                # 16-bit grayscale: Pillow's I;16 modes (PNG, TIFF), or "I" for a 16-bit PGM (and a 16-bit PNG
                # before Pillow 10.3); convert("RGB") clips it at 255
                if img.mode.startswith("I;16") or (img.mode == "I" and opened.format in ("PNG", "PPM")):
                    img = _gray16_to_8bit(img)
                if rgba_background is not None and _has_alpha(img):
                    img = img.convert("RGBA")  # (LA, PA, a palette or RGB with a transparent colour too)
                    flat = Image.new("RGB", img.size, rgba_background)
                    flat.paste(img, mask=img.getchannel("A"))
                    img = flat
                elif img.mode != "RGB":
                    img = img.convert("RGB")
                rgb = np.array(img, dtype=np.uint8)  # [H, W, 3], the one copy out of Pillow
    except MemoryError:
        raise
    except Exception as exc:
        # Pillow's decoders read untrusted bytes: whatever they raise (UnidentifiedImage, OSError, SyntaxError,
        # and from odd formats NotImplementedError, TypeError, AttributeError...) means no readable image
        if isinstance(exc, ImageTooLarge):
            raise
        if isinstance(exc, Image.DecompressionBombError | Image.DecompressionBombWarning):
            found = re.search(r"\((\d+) pixels\)", str(exc))  # Pillow's "Image size (N pixels) exceeds ..."
            raise too_large(param, int(found.group(1)) if found else None) from exc
        raise ParamError(param, invalid_reference(param)) from exc
    if rgb.ndim != 3 or rgb.shape[0] == 0 or rgb.shape[1] == 0:
        raise ParamError(param, invalid_reference(param))
    return rgb


def _gray16_to_8bit(img: Image.Image) -> Image.Image:
    """A 16-bit grayscale image (Pillow's I;16 modes, or "I" read from a 16-bit file) as 8-bit "L", each value
    scaled by 255 / 65535 and rounded (clipped to 0..65535 first). Pillow's convert("RGB") / ("L") clips those
    values at 255 instead, so every pixel above 1/256 of full scale came out white (diffusers' load_image and
    transformers' processors convert that way)."""
    wide = np.clip(np.asarray(img), 0, 65535).astype(np.uint32)  # [H, W] of 0..65535
    return Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8), mode="L")


def _has_alpha(img: Image.Image) -> bool:
    """Whether `img` has transparent pixels' worth of information: an alpha band, or a transparent colour."""
    return img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info


def encode_png(frame: np.ndarray, *, compress_level: int = 6) -> bytes:
    """uint8 (H, W, 3), or a one-frame video (1, H, W, 3), -> PNG bytes (text-to-image output)."""
    if frame.ndim == 4 and frame.shape[0] == 1:
        frame = frame[0]
    if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
        raise ValueError(f"encode_png expects uint8 (H, W, 3), got {frame.dtype} {frame.shape}")
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame), mode="RGB").save(
        buf, format="PNG", compress_level=compress_level
    )
    return buf.getvalue()


def cover_crop_box(src_width: int, src_height: int, width: int, height: int) -> tuple[int, int, int, int]:
    """(resized_width, resized_height, crop_left, crop_top) exactly as diffusers computes them."""
    scale = max(width / src_width, height / src_height)
    resized_h = math.ceil(scale * src_height)
    resized_w = math.ceil(scale * src_width)
    return resized_w, resized_h, round((resized_w - width) / 2), round((resized_h - height) / 2)


def check_cover_size(src_width: int, src_height: int, width: int, height: int, param: str) -> None:
    """A ParamError naming `param` when covering width x height would resize the image past `max_pixels()`.

    The cover scale is set by the side that fits worst, so an image far from the target's aspect ratio
    (1 x 80,000 pixels: a few hundred bytes of PNG) would be resized to gigapixels before the crop; this
    bounds the resize's float32 copy by the largest image decoded at all."""
    resized_w, resized_h, _, _ = cover_crop_box(src_width, src_height, width, height)
    if resized_w * resized_h > max_pixels():
        raise ParamError(param, f"the conditioning image of {src_width}x{src_height} would be resized to "
                         f"{resized_w}x{resized_h} ({resized_w * resized_h:,} pixels) to cover {width}x{height}, "
                         f"above this server's limit of {max_pixels():,} pixels; crop it closer to the "
                         "video's aspect ratio")  # fmt: skip


def resize_center_crop(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """uint8 RGB (h, w, 3) -> uint8 (height, width, 3): cover-resize (antialiased bilinear) + centre crop.

    Mapping the result with `/127.5 - 1` gives exactly the [-1, 1] frame diffusers' Cosmos3 pipeline feeds
    the VAE. Runs on the CPU with torch's intra-op threads.
    """
    import torch  # lazy: the rest of media/ stays importable without torch
    import torch.nn.functional as F

    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"resize_center_crop expects uint8 (H, W, 3), got {image.dtype} {image.shape}")
    if width <= 0 or height <= 0:
        raise ValueError(f"target size must be positive, got {width}x{height}")
    src_h, src_w = image.shape[:2]
    resized_w, resized_h, left, top = cover_crop_box(src_w, src_h, width, height)
    if not (image.flags.c_contiguous and image.flags.writeable):
        image = np.array(image, order="C", copy=True)
    # Same tensor as the pipeline builds (channels-last strides), so the same ATen loop runs.
    x = torch.from_numpy(image).unsqueeze(0).permute(0, 3, 1, 2).to(torch.float32)  # [1, 3, h, w]
    x = F.interpolate(x, size=(resized_h, resized_w), mode="bilinear", align_corners=False, antialias=True)
    x = x[0, :, top : top + height, left : left + width]  # [3, height, width]
    return x.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
