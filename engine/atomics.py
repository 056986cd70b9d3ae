"""The thread crew's synchronisation in LLVM IR (numba `intrinsic`): atomic add and load on
an int64 board, sched_yield, and typed pointers from addresses (a job's arrays reach a
helper thread as addresses on the board).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _int64_slot(context, builder, sig, args):
    # pointer to a[i] of a 1-D int64 array (args[0], args[1])
    a = context.make_array(sig.args[0])(context, builder, args[0])
    return builder.gep(a.data, [context.cast(builder, args[1], sig.args[1], types.int64)])


def _is_int64_vector(a) -> bool:
    return isinstance(a, types.Array) and a.dtype == types.int64 and a.ndim == 1 and a.layout == "C"


@intrinsic
def atomic_add(typingctx, a, i, v):
    """a[i] += v in one atomic step (sequentially consistent); returns the value before. a: 1-D
    int64, C-contiguous: the counters threads share a piece of work by."""
    if not (_is_int64_vector(a) and isinstance(i, types.Integer) and isinstance(v, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _int64_slot(context, builder, sig, args),
                                  context.cast(builder, args[2], sig.args[2], types.int64), "seq_cst")

    return types.int64(a, i, v), codegen


@intrinsic
def atomic_load(typingctx, a, i):
    """a[i], read atomically with acquire order (what another thread wrote before its
    atomic_add of it is visible after)."""
    if not (_is_int64_vector(a) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_int64_slot(context, builder, sig, args), "acquire", 8)

    return types.int64(a, i), codegen


@intrinsic
def yield_cpu(typingctx):
    """sched_yield(2): let another runnable thread have this CPU, if there is one (an I/O
    thread, the daemon's socket thread); returns at once otherwise."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


def _pointer_from(dtype):
    @intrinsic
    def pointer(typingctx, addr):
        # an address (int64) as a typed pointer, for nb.carray
        if not isinstance(addr, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            return builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.int64),
                                    context.get_value_type(types.CPointer(dtype)))

        return types.CPointer(dtype)(addr), codegen

    return pointer


i8_at, u8_at, u16_at, i32_at, i64_at, f32_at = (_pointer_from(t) for t in (types.int8, types.uint8, types.uint16, types.int32,
                                                                          types.int64, types.float32))
