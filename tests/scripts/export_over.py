"""Run by tests/test_export_atomic.py, which stops it part-way (ACCELERATE_RECIPES_FAULT=export_<phase>,
tests/probes/sitecustomize.py): the export of a tiny model (seed SEED) into OUT_DIR, over an earlier one.

    python tests/scripts/export_over.py OUT_DIR SEED [--two_renames]

--two_renames: as on a file system that cannot swap two folders in one step (NFS), the swap falls
back to two renames (common/files.py)."""

import sys

from accelerate import Accelerator
from accelerate.utils import set_seed

from common import files
from common.data import build_tokenizer
from common.export import export_pretrained
from common.model import build_model
from train_extras.options import TrainConfig


def tiny_model(seed: int):
    set_seed(seed)
    return build_model(TrainConfig(preset="debug"), 259)


if __name__ == "__main__":
    out_dir, seed = sys.argv[1], int(sys.argv[2])
    if "--two_renames" in sys.argv:
        files._exchange = lambda a, b: False
    export_pretrained(Accelerator(cpu=True), tiny_model(seed), build_tokenizer(TrainConfig()), out_dir)
    print(f"exported {out_dir}")
