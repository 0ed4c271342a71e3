"""Image folders and packs (ddpkit.data.images, ddpkit.data.shards): crops that depend on nothing but the sample,
the GPU path's arithmetic (run on the CPU), packs read exactly as their folders, bad data, and `ddpkit train` on
files: 2 processes x B = 1 x 2B, an exact mid-epoch resume, every sample once per epoch on 2 ranks and 2 nodes."""

from __future__ import annotations

import logging
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import max_relative_difference, run_command, train, train_here

from ddpkit.app.cli import main
from ddpkit.core.errors import UsageError
from ddpkit.data import images, sample_images, shards

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """48 training and 8 validation JPEGs of 4 classes (small: 64x48), and its pack (several shards per split)."""
    root = tmp_path_factory.mktemp("images")
    sample_images.write_folder(str(root / "jpegs"), images=48, classes=4, val_images=8, size=(64, 48))
    shards.pack(str(root / "jpegs"), str(root / "packed"), shard_mb=0.05)
    return root


def batch(data: images.ImageData, keys) -> tuple[torch.Tensor, torch.Tensor]:
    return data.to_device(data.collate([data[key] for key in keys]), CPU)


def test_a_samples_crop_depends_only_on_seed_epoch_and_index(folder):
    data = images.image_folder(str(folder / "jpegs" / "train"), size=24)
    first, _ = batch(data, [(0, 5), (0, 6)])
    again, _ = batch(data, [(0, 6), (1, 5), (0, 5)])  # another batch, order and neighbour
    assert torch.equal(first[0], again[2]) and torch.equal(first[1], again[0])
    assert not torch.equal(first[0], again[1])  # the next epoch crops it anew
    reseeded = images.image_folder(str(folder / "jpegs" / "train"), size=24, seed=1)
    assert not torch.equal(first[0], batch(reseeded, [(0, 5)])[0][0])
    # Normalised like torchvision's ToTensor + Normalize(ImageNet): mean about 0 over a batch, float32.
    assert first.dtype == torch.float32 and first.shape == (2, 3, 24, 24) and first.abs().max() < 3


def test_crops_are_random_resized_crops_and_centre_crops():
    crops = images.Crops(224, train=True)
    import random

    boxes = [crops.box(375, 500, random.Random(seed)) for seed in range(400)]
    areas = [h * w / (375 * 500) for _, _, h, w, _ in boxes]
    assert 0.08 <= min(areas) < 0.15 and max(areas) > 0.9 and 0.4 < sum(areas) / len(areas) < 0.65
    assert all(0 <= top and top + h <= 375 and 0 <= left and left + w <= 500 for top, left, h, w, _ in boxes)
    assert 150 < sum(flip for *_, flip in boxes) < 250
    # Validation: Resize(256) + CenterCrop(224)'s square, in source pixels: 375 * 224/256 = 328.
    assert images.Crops(224, train=False).box(375, 500, None) == (23, 86, 328, 328, False)


def test_the_gpu_path_crops_as_the_cpu_path_does(folder):
    # decode="gpu" on a CPU device: torchvision's batched decode_jpeg there, the same crops, resampled batched.
    level = 1 / (255 * min(images.IMAGENET_STD))  # one uint8 level, normalised (the most, over the channels)
    for is_train, tolerance in ((False, 0.2 * level), (True, 0.1)):
        cpu = images.image_folder(str(folder / "jpegs" / "train"), size=24, train=is_train)
        gpu = images.image_folder(str(folder / "jpegs" / "train"), size=24, train=is_train, decode="gpu")
        keys = [(1, i) for i in range(12)]
        (a, labels_a), (b, labels_b) = batch(cpu, keys), batch(gpu, keys)
        assert torch.equal(labels_a, labels_b)
        # Validation decodes exactly on both, and the two resamples round differently by one level at most (torch's
        # CPU kernel resamples uint8 in fixed point); training's CPU decoder uses libjpeg's fast DCT (a level or two).
        assert (a - b).abs().mean() <= tolerance, (is_train, (a - b).abs().mean())
        if not is_train:
            assert (a - b).abs().max() <= level * 1.001


def test_batched_crops_are_torchs_antialiased_resize_rounded(monkeypatch):
    # What the GPU path's crops compute, on the CPU: images of three sizes, in several chunks of one size (as a
    # batch of 256 is), random training boxes (enlarged and shrunk, flipped or not), the whole image, one pixel.
    import random

    import torch.nn.functional as F

    monkeypatch.setattr(images, "RESAMPLED_BYTES", 3 * 4 * 3 * 37 * 53 + 1)  # three 37x53 images at once
    generator, rng, size = torch.Generator().manual_seed(0), random.Random(0), 24
    shapes = [(37, 53)] * 7 + [(53, 37)] * 3 + [(20, 20)]
    pictures = [torch.randint(0, 256, (3, h, w), generator=generator, dtype=torch.uint8) for h, w in shapes]
    crops = images.Crops(size, train=True)
    boxes = [(*crops.box(h, w, rng), i) for i, (h, w) in enumerate(shapes)]
    boxes[0], boxes[7] = (0, 0, 37, 53, True, 0), (52, 36, 1, 1, False, 7)
    out = images.resample_batch(pictures, torch.tensor(boxes), size)
    assert out.shape == (len(shapes), 3, size, size) and out.dtype == torch.uint8
    assert images.resample_batch([], torch.empty(0, 6, dtype=torch.long), size, channels=1).shape == (0, 1, size, size)
    for picture, (top, left, height, width, flip, _), got in zip(pictures, boxes, out):
        crop = picture[None, :, top:top + height, left:left + width].float()
        expected = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
        expected = expected.flip(-1) if flip else expected
        assert (got.float() - expected).abs().max() <= 0.5 + 1e-3, (top, left, height, width, flip)  # rounded
        # torch's CPU kernel (fixed point), the CPU path's: within one level.
        assert (got.int() - images.resample(picture, (top, left, height, width), size, flip).int()).abs().max() <= 1


def test_decode_auto_is_the_loader_processes_when_they_keep_up_with_nvjpeg(folder, tmp_path, caplog):
    # The rule: the loader processes when together they decode at least nvJPEG's pace beside a model; ties to them.
    pace = images.NVJPEG_PIXELS_PER_S
    assert images.auto_decode(15, pace / 15) == "cpu" and images.auto_decode(15, pace / 15 * 0.99) == "gpu"
    assert images.auto_decode(0, 1e12) == "gpu"  # no loader processes: nvJPEG, on the loader's thread
    # One core's pace is measured on the data set's own files, as a loader process decodes them (its own decode
    # untouched); an unreadable file costs time and adds no pixels.
    data = images.image_folder(str(folder / "jpegs" / "train"), size=24, decode="auto")
    assert 1e5 < images.pixels_per_core(data, samples=4) < 1e11 and data.decode == "auto"
    broken = tmp_path / "broken"
    sample_images.write_folder(str(broken), images=4, classes=1, size=(64, 48))
    for path in sorted(broken.rglob("*.jpg")):
        path.write_bytes(b"")
    assert images.pixels_per_core(images.image_folder(str(broken), decode="auto"), samples=3) == 0
    # Settled by the loader for its device and workers; on CUDA through `decide` (rank 0's, shared), and said once.
    data.for_device(torch.device("cpu"), 0, decide=lambda choose: pytest.fail("a CPU needs no choice"))
    assert data.decode == "cpu"
    asked = []
    for workers, expected in ((0, "gpu"), (10_000, "cpu")):
        data = images.image_folder(str(folder / "jpegs" / "train"), size=24, decode="auto")
        with caplog.at_level(logging.INFO, logger="ddpkit"):
            data.for_device(torch.device("cuda"), workers, decide=lambda choose: asked.append(choose()) or asked[-1])
        assert data.decode == expected and asked[-1] == expected
        assert f"decode auto: {expected}: {workers} loader processes x " in caplog.text
    data = images.image_folder(str(folder / "jpegs" / "train"), size=24, decode="gpu")
    data.for_device(torch.device("cuda"), 10_000, decide=lambda choose: pytest.fail("gpu was asked for"))
    assert data.decode == "gpu" and images.check_decode("auto", "cuda") == "auto"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvJPEG needs a CUDA GPU (run on the lent GPU machine)")
@pytest.mark.gpu
def test_nvjpeg_decodes_what_the_cpu_decodes(folder):
    cpu = images.image_folder(str(folder / "jpegs" / "train"), size=24, train=False)
    gpu = images.image_folder(str(folder / "jpegs" / "train"), size=24, train=False, decode="gpu")
    keys = [(0, i) for i in range(16)]
    a, _ = batch(cpu, keys)
    b, labels = gpu.to_device(gpu.collate([gpu[key] for key in keys]), torch.device("cuda"))
    assert b.is_cuda and labels.is_cuda and (a - b.cpu()).abs().mean() < 0.05
    # The batched crops on the GPU compute what they compute on the CPU (within a level: TF32, if a run allows it).
    items = [gpu[(0, i)] for i in range(16)]
    decoded = images.decode_jpegs([item[0] for item in items], torch.device("cuda"), 3)
    boxes = torch.tensor([item[1] for item in items])
    on_gpu = images.resample_batch(decoded, boxes, 24).cpu()
    assert (on_gpu.int() - images.resample_batch([d.cpu() for d in decoded], boxes, 24).int()).abs().max() <= 1
    # Through a loader: decoded on a side stream one batch ahead, in order.
    import ddpkit

    with ddpkit.Job("single", device="cuda") as job:
        loader = job.train_loader(gpu, batch_size=8, shuffle=False, workers=2)
        decoded = torch.cat([images.cpu() for images, _ in loader])
    assert (decoded - batch(cpu, range(len(decoded)))[0]).abs().mean() < 0.05


def test_a_pack_holds_the_folder_sample_for_sample(folder):
    for part in ("train", "val"):
        packed = shards.read_pack(str(folder / "packed" / part))
        source = images.scan_folder(str(folder / "jpegs" / part))
        assert packed.labels == source.labels and packed.classes == source.classes == [f"class{k:03d}" for k in range(4)]
        assert all(packed.read(i) == source.read(i) for i in range(len(source)))
    # Each shard is a plain tar in WebDataset's layout: KEY.jpg and KEY.cls (the class) side by side.
    with tarfile.open(folder / "packed" / "train" / "shard-00000.tar") as tar:
        names = tar.getnames()
        assert names[:2] == ["00000000.jpg", "00000000.cls"] and tar.extractfile(names[1]).read() == b"0"
    assert len(list((folder / "packed" / "train").glob("shard-*.tar"))) > 1


def test_bad_folders_and_packs_are_one_line_each(folder, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "no_images" / "cat").mkdir(parents=True)
    (tmp_path / "no_images" / "dog").mkdir()
    (tmp_path / "no_images" / "dog" / "a.jpg").write_bytes((folder / "jpegs" / "val" / "class000" /
                                                             "val000000.jpg").read_bytes())
    cases = [
        (lambda: images.scan_folder(str(tmp_path / "missing")), "no such folder"),
        (lambda: images.scan_folder(str(tmp_path / "empty")), "no class folders in it; expected one sub-folder of "
                                                              "images per class"),
        (lambda: images.scan_folder(str(tmp_path / "no_images")), "Found no valid file for the classes cat"),
        (lambda: images.scan_folder(str(tmp_path / "no_images"), classes=["cat", "cow", "dog"]),
         "its class folders differ from the training set's (missing: cow; extra: none)"),
        (lambda: shards.read_pack(str(folder / "jpegs")), "no index.pt in it, so it is not a finished pack"),
        (lambda: shards.read_pack("s3://bucket/pack"), "ddpkit reads packs from local or mounted folders"),
        (lambda: shards.pack(str(folder / "jpegs"), str(folder / "packed")), "exists and is not empty"),
        (lambda: shards.pack(str(folder / "jpegs"), str(folder / "jpegs" / "packed")), "where it would become a class"),
        (lambda: images.check_decode("gpu", "cpu"), "GPU decoding (decode='gpu') needs a CUDA device"),
    ]
    for make, message in cases:
        with pytest.raises(UsageError) as caught:
            make()
        assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_command_line_says_bad_data_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for argv, message in [
        (["train", "--data", f"folder:{tmp_path / 'empty'}"], "expected one sub-folder of images per class"),
        (["train", "--data", f"shards:{tmp_path / 'empty'}"], "is not a finished pack; make one with ddpkit data pack"),
        (["train", "--data", "shards:s3://bucket/pack"], "ddpkit reads local or mounted folders"),
        (["train", "--decode", "gpu"], "--decode gpu needs a CUDA GPU"),
        (["bench", "--data", f"folder:{tmp_path}", "--decode", "gpu", "--device", "cpu"], "--decode gpu needs"),
        (["data", "make-images", str(tmp_path / "x"), "--size", "500by375"], "--size takes WIDTHxHEIGHT"),
    ]:
        status = main([*argv, "--nproc-per-node", "1", "--output-dir", str(tmp_path / "out")] if argv[0] == "train"
                      else argv)
        err = capsys.readouterr().err
        assert status == 2 and message in err and err.count("\n") == 1, (argv, err)


def test_the_data_commands_make_pack_and_check_a_folder(tmp_path, capsys):
    assert main(["data", "make-images", str(tmp_path / "jpegs"), "--images", "6", "--classes", "2", "--size",
                 "32x24"]) == 0
    assert "wrote 8 JPEGs to" in capsys.readouterr().out  # 6 in train/, and a tenth, at least one per class, in val/
    from PIL import Image

    with Image.open(next((tmp_path / "jpegs" / "val").rglob("*.jpg"))) as image:
        assert image.size == (32, 24) and image.format == "JPEG"
    assert main(["data", "pack", str(tmp_path / "jpegs"), str(tmp_path / "packed")]) == 0
    said = capsys.readouterr().out
    assert "train: 6 images in 1 shard," in said and f"train with --data shards:{tmp_path / 'packed'}" in said
    assert main(["data", "check", f"shards:{tmp_path / 'packed'}", "--workers", "0"]) == 0
    assert "8 of 8 images decode; 0 cannot be read" in capsys.readouterr().out


def test_unreadable_files_are_skipped_named_and_counted(folder, tmp_path, capsys, caplog):
    import shutil

    shutil.copytree(folder / "jpegs" / "val", tmp_path / "val")
    files = sorted((tmp_path / "val").rglob("*.jpg"))
    files[0].write_bytes(files[0].read_bytes()[:1500])  # cut short in its pixel data
    files[1].write_bytes(b"not an image at all")
    files[2].write_bytes(b"")
    for decode in ("cpu", "gpu"):  # the GPU path's fall-back to one-by-one decoding, run on the CPU
        data = images.image_folder(str(tmp_path / "val"), size=16, train=False, decode=decode)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ddpkit"):
            out, labels = batch(data, range(len(data)))
        assert out.shape[0] == labels.shape[0] == len(data) - 3 and data.skipped == 3
        warnings = [record.getMessage() for record in caplog.records]
        assert len(warnings) == 3 and all("skipped an unreadable image" in line for line in warnings)
        said = "\n".join(warnings)
        assert f"{files[0]}: Premature end of JPEG file" in said and f"{files[2]}" in said, said
    # Past the first 20, unreadable files are counted, not named.
    data.skipped = images.NAMED_SKIPS - 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        batch(data, range(len(data)))
    warnings = [record.getMessage() for record in caplog.records]
    assert data.skipped == images.NAMED_SKIPS + 2 and len(warnings) == 2, warnings
    assert "20 unreadable images skipped: more are counted, not named" in warnings[1]
    # A batch with nothing readable stops the run with its files named.
    with pytest.raises(UsageError, match="a batch held no readable image"):
        batch(data, [1, 2])
    # `ddpkit data check` lists all three (exit 1).
    capsys.readouterr()
    assert main(["data", "check", f"folder:{tmp_path / 'val'}", "--workers", "0"]) == 1
    said = capsys.readouterr().out
    assert said.count("unreadable: ") == 3 and "5 of 8 images decode; 3 cannot be read" in said


def test_ddpkit_train_counts_the_skipped_files_in_its_metrics(folder, tmp_path, capsys):
    import shutil

    shutil.copytree(folder / "jpegs", tmp_path / "jpegs")
    damaged = sorted((tmp_path / "jpegs" / "train").rglob("*.jpg"))[5]
    damaged.write_bytes(damaged.read_bytes()[:1500])
    _, rows = train_here(tmp_path / "out", "--model", "convnet", "--image-size", "16", "--epochs", "2", "--workers", "0",
                         "--data", f"folder:{tmp_path / 'jpegs'}", "--batch-size", "16")
    # Every pass over the training part meets it once; the validation part has none.
    assert [row["skipped_samples"] for row in rows] == [1, 1]
    err = capsys.readouterr().err
    assert err.count(f"ddpkit: warning: skipped an unreadable image: {damaged}: Premature end of JPEG file") == 2


def test_other_formats_and_grey_images_decode(tmp_path):
    from PIL import Image

    picture = Image.new("RGB", (30, 20), (200, 30, 60))
    for suffix in ("png", "bmp", "tiff"):
        picture.save(tmp_path / f"a.{suffix}")
        decoded = images.decode_on_cpu((tmp_path / f"a.{suffix}").read_bytes(), channels=3)
        assert decoded.shape == (3, 20, 30) and decoded[:, 0, 0].tolist() == [200, 30, 60]
    picture.save(tmp_path / "a.jpg", quality=95)
    grey = images.decode_on_cpu((tmp_path / "a.jpg").read_bytes(), channels=1)
    assert grey.shape == (1, 20, 30)


@pytest.fixture(scope="module")
def trained(folder, tmp_path_factory):
    """`ddpkit train` on the folder: 2 processes x 4 with a checkpoint every 2 steps (in a new process, as users run
    it), and in this process 1 x 8 from the folder and from the pack, with the same checkpoints."""
    out = tmp_path_factory.mktemp("trained")
    # Crops belong to samples, not to loader processes: no workers on 2 processes, one on 1 process.
    two = train(out / "two", *TRAIN, "--data", f"folder:{folder / 'jpegs'}", "--nproc-per-node", "2",
                "--batch-size", "4", "--workers", "0")
    one = train_here(out / "one", *TRAIN, "--data", f"folder:{folder / 'jpegs'}", "--batch-size", "8", "--workers", "1")
    packed = train_here(out / "packed", *TRAIN, "--data", f"shards:{folder / 'packed'}", "--batch-size", "8",
                        "--workers", "0")
    return out, two, one, packed


TRAIN = ["--model", "convnet", "--image-size", "20", "--optimizer", "sgd", "--lr", "0.002", "--epochs", "2",
         "--checkpoint-every", "2", "--keep-checkpoints", "100"]


def test_two_processes_on_files_equal_one_with_twice_the_batch(trained):
    _, (two, rows_two), (one, rows_one), _ = trained
    assert rows_two[-1]["world_size"] == 2 and rows_one[-1]["world_size"] == 1 and rows_two[-1]["steps"] == 6
    assert max_relative_difference(two, one) <= 1e-5
    assert rows_two[-1]["val_count"] == rows_one[-1]["val_count"] == 8
    assert rows_two[-1]["skipped_samples"] == 0


def test_a_pack_trains_exactly_as_its_folder(trained):
    _, _, (one, _), (packed, _) = trained
    assert all(torch.equal(one[key], packed[key]) for key in one)


def test_a_resume_mid_epoch_on_files_is_bit_identical(trained, folder):
    out, _, (one, _), _ = trained
    # After step 2 of 6 in the first epoch: the order and every crop continue where they were.
    resumed, rows = train_here(out / "resumed", *TRAIN, "--data", f"folder:{folder / 'jpegs'}", "--batch-size", "8",
                               "--workers", "1", "--resume", str(out / "one" / "checkpoints" / "step-00000002.pt"))
    assert rows[0]["resumed_at_step"] == 2
    assert all(torch.equal(one[key], resumed[key]) for key in one)


def test_every_sample_once_per_epoch_across_two_ranks(one_image_per_class):
    # Each rank's share as ddpkit.train_loader deals it (replica=(rank, 2)), in this process; on two real ranks
    # (and two nodes) in tests/test_multinode.py.
    import ddpkit

    root = one_image_per_class
    with ddpkit.Job("single", device="cpu") as job:
        for data in (ddpkit.image_folder(str(root / "jpegs"), size=8), ddpkit.image_shards(str(root / "packed"), size=8)):
            loaders = [ddpkit.train_loader(data, 4, runtime=job.runtime, replica=(rank, 2)) for rank in range(2)]
            seen = [[[label for _, labels in loader for label in labels.tolist()] for _ in range(2)] for loader in loaders]
            for epoch in range(2):
                assert sorted(seen[0][epoch] + seen[1][epoch]) == list(range(16)), seen
            assert seen[0][0] != seen[0][1]  # a new order in the second epoch


def test_batches_are_made_ready_ahead_on_a_thread_in_order_and_stopped_with_the_pass():
    # The GPU loaders' thread (nvJPEG's decoding off the training thread), run with CPU tensors: no streams.
    import threading
    import time

    from ddpkit.data.loaders import AHEAD, ahead_on_a_thread

    def source(pulled: list[int], count: int):
        for i in range(count):
            pulled.append(i)
            yield torch.full((2,), i)

    where = []

    def move(batch):
        where.append(threading.current_thread().name)
        if int(batch[0]) == 5:
            raise UsageError("batch 5 held no readable image")
        return batch * 10

    pulled: list[int] = []
    taken = []
    with pytest.raises(UsageError, match="batch 5"):
        for k, batch in enumerate(ahead_on_a_thread(source(pulled, 8), move, CPU)):
            # A step: the thread makes the next ones ready meanwhile, AHEAD of them and no more (batch 5 fails:
            # nothing is read after it).
            expected, deadline = min(k + 1 + AHEAD, 6), time.monotonic() + 10
            while len(pulled) < expected and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)
            assert len(pulled) == expected, (k, pulled)
            taken.append(int(batch[0]))
    assert taken == [0, 10, 20, 30, 40]  # in order; the error where its batch was, after the ones before it
    assert set(where) == {"ddpkit-batches-ahead"}

    pulled.clear()
    batches = ahead_on_a_thread(source(pulled, 100), move, CPU)
    assert int(next(batches)[0]) == 0
    batches.close()  # a loop that breaks off: its thread ends with it, and reads no further
    assert not any(thread.name == "ddpkit-batches-ahead" for thread in threading.enumerate())
    assert len(pulled) <= 1 + AHEAD
    assert [int(b[0]) for b in ahead_on_a_thread(source([], 3), move, CPU)] == [0, 10, 20]


def test_a_training_loader_over_files_keeps_its_workers_and_its_order(folder, tmp_path):
    # Persistent workers: the same processes serve every epoch, a pass left mid-epoch is dealt again whole, and a
    # script that leaves its loop mid-epoch still exits (its workers ignore SIGTERM; ddpkit ends them at exit).
    import itertools
    import sys

    import ddpkit

    data = ddpkit.image_folder(str(folder / "jpegs" / "train"), size=8)
    with ddpkit.Job("single", device="cpu") as job:
        kept = ddpkit.train_loader(data, 8, runtime=job.runtime, workers=2)
        fresh = ddpkit.train_loader(data, 8, runtime=job.runtime, workers=0)
        assert kept.loader.persistent_workers and not fresh.loader.persistent_workers

        def labels(loader, stop=None):
            return [label for _, batch in itertools.islice(loader, stop) for label in batch.tolist()]

        assert labels(kept) == labels(fresh)  # epoch 0
        workers = [worker.pid for worker in kept.loader._iterator._workers]  # noqa: SLF001
        assert len(labels(kept, 1)) == 8  # epoch 1, left after a batch: the next pass deals epoch 1 again
        assert labels(kept) == labels(fresh)
        assert [worker.pid for worker in kept.loader._iterator._workers] == workers  # noqa: SLF001
        assert ddpkit.train_loader(data, 8, runtime=job.runtime, workers=2, persistent_workers=False).loader \
            .persistent_workers is False
    script = tmp_path / "leaves.py"
    script.write_text(f"""import ddpkit
with ddpkit.Job("single", device="cpu") as job:
    loader = ddpkit.train_loader(ddpkit.image_folder({str(folder / "jpegs" / "train")!r}, size=8), 8,
                                 runtime=job.runtime, workers=2)
    next(iter(loader))
    print("left mid-epoch")
""")
    done = run_command([sys.executable, str(script)], timeout=60, warm=True)
    assert done.returncode == 0 and "left mid-epoch" in done.stdout, done.stderr
