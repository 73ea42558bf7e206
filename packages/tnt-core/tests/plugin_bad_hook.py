from tnt_core import hookimpl


@hookimpl
def tnt_comm_backend():  # typo: the hook is tnt_comm_backends
    return []
