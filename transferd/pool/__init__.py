"""Named shared-memory pools (:mod:`.shm`) and the row copies into them (:mod:`.rows`)."""

from .shm import ALIGN, HEADER_FORMAT, MAGIC, Pool, host_boot_id, pool_path, shm_dir

__all__ = ["ALIGN", "HEADER_FORMAT", "MAGIC", "Pool", "host_boot_id", "pool_path", "shm_dir"]
