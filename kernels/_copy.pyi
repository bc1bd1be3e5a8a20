"""Types of the native copy kernel (kernels/_copy.c)."""

class MemoryFault(Exception):
    """A copy touched memory that is gone (SIGBUS): a shared mapping was truncated under it."""

    address: int
    side: str  # "dst", "src", or "" when the address lies in neither buffer
    offset: int  # into that buffer

def copy(
    dst: object,
    src: object,
    dst_offsets: object,
    src_offsets: object,
    lengths: object,
    threads: int = ...,
) -> int: ...
def install_fault_handler() -> bool: ...
def fault_handler_installed() -> bool: ...
