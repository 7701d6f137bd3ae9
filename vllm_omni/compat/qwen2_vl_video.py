"""Qwen2-VL video processing on PIL and NumPy, for machines where torchvision cannot load.

transformers ships Qwen2-VL's video processor only on its torchvision backend, and
`Qwen2_5OmniProcessor` (also Qwen2-VL's and Qwen2.5-VL's processors) always builds one, so without
torchvision no Omni request can even be processed, video or not. This processor computes the same
`pixel_values_videos` / `video_grid_thw`: frames resized to a multiple of patch x merge within the
pixel limits, rescaled, normalised, and cut into temporal x spatial patches in the vision
encoder's order. Resizing is PIL's bicubic, as in transformers' PIL image processor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    PILImageResampling,
    SizeDict,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.processing_utils import VideosKwargs
from transformers.video_processing_utils import VideoProcessorMixin
from transformers.video_utils import VideoMetadata, make_batched_metadata, make_batched_videos


class QwenVideoKwargs(VideosKwargs, total=False):
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool
    max_video_tokens: int


class Qwen2VLVideoProcessor(VideoProcessorMixin, PilBackend):
    """Named like transformers' class so that configs naming it resolve to this one."""

    resample = PILImageResampling.BICUBIC
    size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}
    image_mean = OPENAI_CLIP_MEAN
    image_std = OPENAI_CLIP_STD
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    patch_size = 14
    temporal_patch_size = 2
    merge_size = 2
    min_frames = 4
    max_frames = 768
    do_sample_frames = False
    cap_pixels_per_frame = None
    max_video_tokens = 128000
    valid_kwargs = QwenVideoKwargs
    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, **kwargs: Any) -> None:
        size = dict(kwargs.pop("size", None) or self.size)
        # Older configs give the pixel limits as min_pixels / max_pixels.
        if (min_pixels := kwargs.pop("min_pixels", None)) is not None:
            size["shortest_edge"] = min_pixels
        if (max_pixels := kwargs.pop("max_pixels", None)) is not None:
            size["longest_edge"] = max_pixels
        super().__init__(size=size, **kwargs)

    def _standardize_kwargs(
        self, size=None, min_pixels: int | None = None, max_pixels: int | None = None, **kwargs
    ) -> dict:
        if min_pixels is not None or max_pixels is not None:
            size = dict(size or {})
            if min_pixels is not None:
                size["shortest_edge"] = min_pixels
            if max_pixels is not None:
                size["longest_edge"] = max_pixels
        return super()._standardize_kwargs(size=size, **kwargs)

    def sample_frames(
        self,
        metadata: VideoMetadata,
        temporal_patch_size: int | None = None,
        min_frames: int | None = None,
        max_frames: int | None = None,
        num_frames: int | None = None,
        fps: float | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Indices of the frames to keep: `num_frames`, or `fps` frames per second of video,
        a multiple of the temporal patch size, spread evenly over the video."""
        num_frames = num_frames if num_frames is not None else self.num_frames
        fps = fps if fps is not None else self.fps
        if num_frames is not None and fps is not None:
            raise ValueError("give num_frames or fps to sample a video, not both")
        step = temporal_patch_size or self.temporal_patch_size
        total = metadata.total_num_frames
        if num_frames is not None:
            count = round(num_frames / step) * step
        elif fps is not None:
            if metadata.fps is None:
                raise ValueError("sampling by fps needs the video's fps in its metadata")
            most = math.floor(min(max_frames or self.max_frames, total) / step) * step
            count = total / metadata.fps * fps
            count = min(max(count, min_frames or self.min_frames), most, total)
            count = math.floor(count / step) * step
        else:
            return torch.arange(total).int()
        if not 0 < count <= total:
            raise ValueError(f"cannot sample {count} frames from a video of {total} frames")
        # float32 steps, as transformers' processor takes them, so both keep the same frames
        return torch.arange(0, total, total / count).int()

    def _decode_and_sample_videos(
        self, videos, video_metadata=None, do_sample_frames=None, sample_indices_fn=None
    ) -> tuple[list, list]:
        videos = make_batched_videos(videos)
        metadata = make_batched_metadata(videos, video_metadata=video_metadata)
        if do_sample_frames:
            for i, (video, meta) in enumerate(zip(videos, metadata, strict=True)):
                meta.frames_indices = sample_indices_fn(metadata=meta)
                videos[i] = video[meta.frames_indices]
        return videos, metadata

    def _prepare_input_videos(
        self, videos, do_convert_rgb=None, input_data_format=None, device=None
    ) -> list[np.ndarray]:
        """Each video as a (frames, channels, height, width) array."""
        return [
            np.stack([
                self.process_image(
                    frame, do_convert_rgb=do_convert_rgb, input_data_format=input_data_format
                )
                for frame in video
            ])
            for video in videos
        ]

    def _preprocess(
        self,
        videos: list[np.ndarray],
        do_resize: bool,
        size: SizeDict,
        resample: PILImageResampling | None,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: float | list[float] | None,
        image_std: float | list[float] | None,
        patch_size: int,
        temporal_patch_size: int,
        merge_size: int,
        return_tensors: str | None = None,
        **kwargs: Any,
    ) -> BatchFeature:
        patches, grids = [], []
        for video in videos:
            frames = []
            for frame in video:
                if do_resize:
                    height, width = smart_resize(
                        frame.shape[1], frame.shape[2], patch_size * merge_size,
                        min_pixels=size.shortest_edge, max_pixels=size.longest_edge,
                    )
                    frame = self.resize(frame, SizeDict(height=height, width=width), resample)
                if do_rescale:
                    frame = self.rescale(frame, rescale_factor)
                if do_normalize:
                    frame = self.normalize(frame, image_mean, image_std)
                frames.append(frame)
            video_patches, grid = _patchify(np.stack(frames), patch_size, temporal_patch_size,
                                            merge_size)
            patches.append(video_patches)
            grids.append(grid)
        return BatchFeature(
            {"pixel_values_videos": np.concatenate(patches),
             "video_grid_thw": np.array(grids, dtype=np.int64)},
            tensor_type=return_tensors,
        )

    def get_num_of_video_patches(
        self, num_frames: int, height: int, width: int, videos_kwargs: dict | None = None
    ) -> int:
        kwargs = videos_kwargs or {}
        size = kwargs.get("size") or self.size
        patch = kwargs.get("patch_size") or self.patch_size
        merge = kwargs.get("merge_size") or self.merge_size
        temporal = kwargs.get("temporal_patch_size") or self.temporal_patch_size
        height, width = smart_resize(
            height, width, patch * merge,
            min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"],
        )
        return math.ceil(num_frames / temporal) * (height // patch) * (width // patch)


def _patchify(
    frames: np.ndarray, patch: int, temporal: int, merge: int
) -> tuple[np.ndarray, list[int]]:
    """(T, C, H, W) frames -> (patches, C * temporal * patch * patch) rows and [t, h, w] grid.

    Rows run over time, then merge windows (merge x merge neighbouring patches, which the vision
    encoder fuses into one token) in raster order, then the patches inside each window."""
    if pad := -len(frames) % temporal:  # the last frame fills the last temporal patch
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    t, channels, height, width = frames.shape
    grid = [t // temporal, height // patch, width // patch]
    blocks = frames.reshape(
        grid[0], temporal, channels,
        grid[1] // merge, merge, patch,
        grid[2] // merge, merge, patch,
    )
    # -> (t, window row, window col, row in window, col in window, channel, frame, y, x)
    blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return blocks.reshape(grid[0] * grid[1] * grid[2], -1), grid


def register() -> None:
    """Make transformers' auto classes build this processor for Qwen2-VL-family models."""
    import transformers

    # Processors type-check their video processor against `transformers.VideoProcessorMixin`,
    # which the package exports only when torchvision is there (the class itself needs none).
    if not hasattr(transformers, "VideoProcessorMixin"):
        transformers.VideoProcessorMixin = VideoProcessorMixin
    # the package-level name is a placeholder without torchvision; the module has the class
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor
    from transformers.models.qwen2_5_omni import Qwen2_5OmniConfig
    from transformers.models.qwen2_5_vl import Qwen2_5_VLConfig
    from transformers.models.qwen2_vl import Qwen2VLConfig

    backends = {"torchvision": Qwen2VLVideoProcessor, "pil": Qwen2VLVideoProcessor}
    for config in (Qwen2VLConfig, Qwen2_5_VLConfig, Qwen2_5OmniConfig):
        AutoVideoProcessor.register(config, video_processor_classes=backends, exist_ok=True)
