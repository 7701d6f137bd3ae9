"""The torchvision-free Qwen2-VL video processor against transformers' PIL image processor."""

from __future__ import annotations

import numpy as np
import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.video_utils import VideoMetadata

from vllm_omni.compat.qwen2_vl_video import Qwen2VLVideoProcessor

RNG = np.random.default_rng(0)
SIZE = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 256}  # the Omni preprocessor's


def frames(n: int, height: int = 61, width: int = 97) -> np.ndarray:
    return RNG.integers(0, 256, (n, height, width, 3), dtype=np.uint8)


def test_a_still_video_is_the_image():
    # The image processor repeats an image over the temporal patch: a two-frame still video
    # must give the same patches, in the same order, and the same grid.
    frame = frames(1)[0]
    video = Qwen2VLVideoProcessor(size=SIZE)(videos=[np.stack([frame, frame])], return_tensors="np")
    image = Qwen2VLImageProcessorPil(size=SIZE)(images=[frame], return_tensors="np")
    assert video["video_grid_thw"].tolist() == image["image_grid_thw"].tolist()
    np.testing.assert_array_equal(video["pixel_values_videos"], image["pixel_values"])


def test_frames_go_to_their_temporal_slot_and_the_last_pads():
    video = frames(3)
    out = Qwen2VLVideoProcessor(size=SIZE)(videos=[video], return_tensors="np")
    (t, h, w), = out["video_grid_thw"].tolist()
    assert t == 2  # 3 frames padded to 4 with the last one
    rows = out["pixel_values_videos"].reshape(t, h * w, 3, 2, 14 * 14)  # channel, frame, pixels
    image = Qwen2VLImageProcessorPil(size=SIZE)
    for i, (slot, k) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        one = image(images=[video[min(i, 2)]], return_tensors="np")["pixel_values"]
        np.testing.assert_array_equal(rows[slot, :, :, k], one.reshape(h * w, 3, 2, 196)[:, :, 0])


def test_several_videos_of_other_sizes():
    videos = [frames(4), frames(2, 120, 40)]
    out = Qwen2VLVideoProcessor(size=SIZE)(videos=videos, return_tensors="pt")
    grids = out["video_grid_thw"].tolist()
    assert grids == [[2, 4, 6], [1, 8, 2]]
    assert out["pixel_values_videos"].shape == (2 * 4 * 6 + 8 * 2, 3 * 2 * 14 * 14)
    assert Qwen2VLVideoProcessor(size=SIZE).get_num_of_video_patches(2, 120, 40) == 16


def test_sampling_by_fps():
    processor = Qwen2VLVideoProcessor(size=SIZE)
    meta = VideoMetadata(total_num_frames=90, fps=30)  # 3 s: 2 fps -> 6 frames
    assert processor.sample_frames(meta, fps=2).tolist() == [0, 15, 30, 45, 60, 75]
    assert len(processor.sample_frames(VideoMetadata(total_num_frames=9, fps=30), fps=2)) == 4
    with pytest.raises(ValueError, match="not both"):
        processor.sample_frames(meta, fps=2, num_frames=4)
    out = processor(videos=[frames(90, 28, 28)], video_metadata=[meta], do_sample_frames=True,
                    fps=2, return_tensors="np")
    assert out["video_grid_thw"].tolist() == [[3, 4, 4]]  # 28x28 is below the minimum: 56x56
