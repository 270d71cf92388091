// Python bindings of the native layer (pccl._native). Buffers arrive as raw addresses
// from torch tensors that pccl's Python layer has validated and keeps alive; every call
// that communicates or computes releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <mpi4py/mpi4py.h>

#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>  // Open MPI's MPIX_Query_cuda_support / MPIX_Query_rocm_support
#endif

#include "comm.h"
#include "quantize.h"
#include "reduce.h"
#ifdef PCCL_GPU
#include "gpu/gpu.h"
#endif

namespace nb = nanobind;
using namespace pccl;

namespace {

class ExitTimer {
 public:
  ExitTimer(double seconds, int code, std::string message)
      : message_(std::move(message) + "\n"), thread_([this, seconds, code] {
          std::unique_lock<std::mutex> lock(mutex_);
          if (cancelled_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return done_; })) return;
          (void)!write(2, message_.data(), message_.size());
          _exit(code);
        }) {}
  ~ExitTimer() { cancel(); }

  void cancel() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    cancelled_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cancelled_;
  bool done_ = false;
  const std::string message_;   // said on stderr as it ends the process
  std::thread thread_;   // last: it starts once the members it reads exist
};

using OpsTable = nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// A collective's codec argument: -1 none, else a native codec's code.
std::optional<Codec> codec_of(int code) {
  if (code < 0) return std::nullopt;
  return Codec(code);
}

MPI_Comm as_mpi_comm(nb::handle obj) {
  if (!PyObject_TypeCheck(obj.ptr(), &PyMPIComm_Type))
    throw nb::type_error("expected an mpi4py.MPI.Comm");
  MPI_Comm* comm = PyMPIComm_Get(obj.ptr());
  if (comm == nullptr) throw nb::python_error();
  if (*comm == MPI_COMM_NULL) throw nb::value_error("the mpi4py communicator is MPI.COMM_NULL");
  return *comm;
}

void* ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

// Whether the MPI library takes device pointers of `platform` ("cuda" or "hip"), as the
// library itself answers at run time: 1 yes, 0 no, -1 it has no way to say (then pccl falls
// back to the library's documented switches). MPICH >= 4.0 has MPIX_GPU_query_support;
// Open MPI has MPIX_Query_cuda_support (and MPIX_Query_rocm_support from 5.0) where it was
// built with that extension.
int mpi_gpu_support(const std::string& platform) {
  if (platform != "cuda" && platform != "hip")
    throw nb::value_error(("platform must be 'cuda' or 'hip', got '" + platform + "'").c_str());
#if defined(MPIX_GPU_SUPPORT_CUDA) && defined(MPIX_GPU_SUPPORT_HIP)
  int supported = 0;
  if (MPIX_GPU_query_support(platform == "hip" ? MPIX_GPU_SUPPORT_HIP : MPIX_GPU_SUPPORT_CUDA, &supported) !=
      MPI_SUCCESS)
    return -1;
  return supported ? 1 : 0;
#else
  // The macro says whether this Open MPI was built with the support, the call whether it
  // is on at run time.
  if (platform == "cuda") {
#if defined(MPIX_CUDA_AWARE_SUPPORT)
    return MPIX_CUDA_AWARE_SUPPORT && MPIX_Query_cuda_support() ? 1 : 0;
#endif
  } else {
#if defined(MPIX_ROCM_AWARE_SUPPORT)
    return MPIX_ROCM_AWARE_SUPPORT && MPIX_Query_rocm_support() ? 1 : 0;
#endif
  }
  return -1;
#endif
}

// A workspace block held as the Python object that owns it (a torch tensor from the
// allocator pccl's Python layer passes). Made and dropped with the GIL held; at
// interpreter exit the object is left to the process's end.
struct PythonBlock : Block {
  nb::object owner;
  ~PythonBlock() override {
    if (!nb::is_alive()) {
      owner.release();
      return;
    }
    nb::gil_scoped_acquire gil;
    owner.reset();
  }
};

// allocate(nbytes, device, pinned) -> a tensor of at least nbytes bytes: on `device`
// (-1: host; pinned: page-locked host memory). Called from the executor (GIL released)
// only when a workspace grows.
Allocator python_allocator(nb::object allocate) {
  if (allocate.is_none()) return nullptr;
  auto shared = std::shared_ptr<nb::object>(new nb::object(std::move(allocate)), [](nb::object* o) {
    if (!nb::is_alive()) return void(o->release());
    nb::gil_scoped_acquire gil;
    delete o;
  });
  return [shared](size_t bytes, int device, bool pinned) -> std::unique_ptr<Block> {
    nb::gil_scoped_acquire gil;
    auto block = std::make_unique<PythonBlock>();
    block->owner = (*shared)(bytes, device, pinned);
    block->data = reinterpret_cast<char*>(nb::cast<uintptr_t>(block->owner.attr("data_ptr")()));
    return block;
  };
}

// The MPI the extension was compiled against, to compare with the one mpi4py loads.
const char* compiled_mpi() {
#if defined(OPEN_MPI)
  return "Open MPI";
#elif defined(MPICH)
  return "MPICH";
#else
  return "unknown";
#endif
}

}  // namespace

NB_MODULE(_native, m) {
  if (import_mpi4py() < 0) throw nb::python_error();
  // Communicators still referenced at interpreter exit (module globals, an engine held in
  // a reference cycle with its model's hooks) are normal Python, not reference-count bugs.
  nb::set_leak_warnings(false);
  m.doc() = "pccl native layer: MPI schedule executor, MPI collectives, CPU reduction kernels";
  // A Timeout becomes pccl.core.errors.CollectiveTimeout: one exception type for C++ and
  // Python executors, defined in Python so that it imports without this module. The class
  // lives as long as the interpreter, so the reference handed to the translator is kept.
  nb::object timeout_class = nb::module_::import_("pccl.core.errors").attr("CollectiveTimeout");
  PyObject *timeout = timeout_class.release().ptr();
  m.attr("CollectiveTimeout") = nb::handle(timeout);
  nb::register_exception_translator(
      [](const std::exception_ptr &p, void *type) {
        try {
          std::rethrow_exception(p);
        } catch (const Timeout &e) {
          PyErr_SetString(static_cast<PyObject *>(type), e.what());
        }
      },
      timeout);
  m.attr("compiled_mpi") = compiled_mpi();
  // A process whose collective failed may hang in MPI_Finalize, which waits for every
  // peer, forever for a dead one: a native thread (it needs no GIL, which the finalizing
  // thread may hold) ends the process with `code`, saying `message`, unless cancel() comes
  // within `seconds`.
  nb::class_<ExitTimer>(m, "ExitTimer")
      .def(nb::init<double, int, std::string>(), nb::arg("seconds"), nb::arg("code"), nb::arg("message"))
      .def("cancel", &ExitTimer::cancel, nb::call_guard<nb::gil_scoped_release>());
  m.def("mpi_gpu_support", &mpi_gpu_support, nb::arg("platform"),
        "1 if the MPI library says it takes device pointers of platform ('cuda' or 'hip'), 0 if it says "
        "not, -1 if it has no query");

  m.def("reduce", [](uintptr_t dst, uintptr_t a, uintptr_t b, int64_t n, int dtype, int op) {
    reduce(ptr(dst), ptr(a), ptr(b), n, static_cast<DType>(dtype), static_cast<Op>(op));
  }, nb::call_guard<nb::gil_scoped_release>(), "dst[i] = op(a[i], b[i]) for n elements (dst may be a)");
  m.def("divide", [](uintptr_t buf, int64_t n, int dtype, int64_t divisor) {
    divide(ptr(buf), n, static_cast<DType>(dtype), divisor);
  }, nb::call_guard<nb::gil_scoped_release>(), "buf[i] /= divisor for n elements (a true division: op avg)");
  m.attr("int8_group") = kGroup;
  m.def("encoded_bytes", [](int codec, int64_t n) { return Codec(codec).bytes(n); },
        "bytes of a native codec's encoding of n values (codec.h)");
  m.def("encode", [](int codec, uintptr_t dst, uintptr_t src, int64_t n, int dtype) {
    Codec(codec).encode(ptr(dst), ptr(src), n, static_cast<DType>(dtype));
  }, nb::call_guard<nb::gil_scoped_release>(), "encode n values with a native codec (codec.h)");
  m.def("decode", [](int codec, uintptr_t dst, uintptr_t src, int64_t n, int dtype, int op) {
    Codec(codec).decode(ptr(dst), ptr(src), n, static_cast<DType>(dtype), op);
  }, nb::call_guard<nb::gil_scoped_release>(), "decode n values; op -1 overwrites dst, else dst = op(dst, decoded)");

#ifdef PCCL_GPU
  m.attr("gpu_platform") = gpu::platform();
  m.def("gpu_reduce", [](uintptr_t dst, uintptr_t a, uintptr_t b, int64_t n, int dtype, int op, uintptr_t stream) {
    gpu::reduce(ptr(dst), ptr(a), ptr(b), n, static_cast<DType>(dtype), static_cast<Op>(op), ptr(stream));
  }, nb::call_guard<nb::gil_scoped_release>(), "dst[i] = op(a[i], b[i]) on a GPU stream");
  m.def("gpu_divide", [](uintptr_t buf, int64_t n, int dtype, int64_t divisor, uintptr_t stream) {
    gpu::divide(ptr(buf), n, static_cast<DType>(dtype), divisor, ptr(stream));
  }, nb::call_guard<nb::gil_scoped_release>(), "buf[i] /= divisor on a GPU stream (a true division: op avg)");
  m.def("gpu_encode", [](int codec, uintptr_t dst, uintptr_t src, int64_t n, int dtype, uintptr_t stream) {
    gpu::encode(codec, ptr(dst), ptr(src), n, static_cast<DType>(dtype), ptr(stream));
  }, nb::call_guard<nb::gil_scoped_release>(), "encode n values with a native codec on a GPU stream");
  m.def("gpu_decode", [](int codec, uintptr_t dst, uintptr_t src, int64_t n, int dtype, int op, uintptr_t stream) {
    gpu::decode(codec, ptr(dst), ptr(src), n, static_cast<DType>(dtype), op, ptr(stream));
  }, nb::call_guard<nb::gil_scoped_release>(), "decode n values with a native codec on a GPU stream");
#else
  m.attr("gpu_platform") = nb::none();
#endif

  // Collectives take the buffers' device (-1: host) and the caller's stream (0: default).
  nb::class_<MpiComm>(m, "MpiComm")
      .def("__init__", [](MpiComm* self, nb::handle comm, double timeout, bool gpu_aware, nb::object allocate,
                          bool emulate_gpu) {
        new (self) MpiComm(as_mpi_comm(comm), timeout, gpu_aware, python_allocator(allocate), emulate_gpu);
      }, nb::arg("comm"), nb::arg("timeout"), nb::arg("gpu_aware") = false, nb::arg("allocate") = nb::none(),
         nb::arg("emulate_gpu") = false,
         "allocate(nbytes, device, pinned) -> tensor gives GPU and pinned workspaces; emulate_gpu (tests): "
         "buffers passed with a device >= 0 are host memory and their stream a stand-in that runs queued work "
         "only when waited for")
      .def("emulated_synchronize", [](MpiComm& c) { c.memory(0, nullptr).sync(); },
           "with emulate_gpu: run the work queued on the stand-in stream (a stream synchronize)")
      .def_prop_ro("emulated_stats", [](const MpiComm& c) {
        const auto& s = c.emulated_stats();
        nb::dict d;
        d["copies"] = s.copies;
        d["kernels"] = s.kernels;
        d["waits"] = s.waits;
        return d;
      }, "with emulate_gpu: copies and kernels queued on the stand-in stream, and the times the CPU waited for it")
      .def_prop_ro("rank", &MpiComm::rank)
      .def_prop_ro("size", &MpiComm::size)
      .def("set_timeout", &MpiComm::set_timeout)
      .def("all_gather", [](MpiComm& c, OpsTable ops, uintptr_t out, uintptr_t in, int64_t count, int dtype,
                            int device, uintptr_t stream, int codec) {
        const std::optional<Codec> coded = codec_of(codec);
        c.all_gather(ops.data(), ops.shape(0), ptr(out), ptr(in), count, static_cast<DType>(dtype),
                     c.memory(device, ptr(stream)), coded ? &*coded : nullptr);
      }, nb::arg("ops"), nb::arg("out"), nb::arg("in"), nb::arg("count"), nb::arg("dtype"), nb::arg("device"),
         nb::arg("stream"), nb::arg("codec") = -1, nb::call_guard<nb::gil_scoped_release>(),
         "codec -1: the plain schedule Schedule.ops; else a native codec and CompressedSchedule.ops")
      .def("reduce_scatter", [](MpiComm& c, OpsTable ops, uintptr_t out, uintptr_t in, int64_t count, int dtype,
                                int op, int device, uintptr_t stream, int codec) {
        const std::optional<Codec> coded = codec_of(codec);
        c.reduce_scatter(ops.data(), ops.shape(0), ptr(out), ptr(in), count, static_cast<DType>(dtype),
                         static_cast<Op>(op), c.memory(device, ptr(stream)), coded ? &*coded : nullptr);
      }, nb::arg("ops"), nb::arg("out"), nb::arg("in"), nb::arg("count"), nb::arg("dtype"), nb::arg("op"),
         nb::arg("device"), nb::arg("stream"), nb::arg("codec") = -1, nb::call_guard<nb::gil_scoped_release>())
      .def("all_reduce", [](MpiComm& c, OpsTable ops, uintptr_t buf, int64_t count, int dtype, int op, int device,
                            uintptr_t stream, int codec) {
        const std::optional<Codec> coded = codec_of(codec);
        c.all_reduce(ops.data(), ops.shape(0), ptr(buf), count, static_cast<DType>(dtype), static_cast<Op>(op),
                     c.memory(device, ptr(stream)), coded ? &*coded : nullptr);
      }, nb::arg("ops"), nb::arg("buf"), nb::arg("count"), nb::arg("dtype"), nb::arg("op"), nb::arg("device"),
         nb::arg("stream"), nb::arg("codec") = -1, nb::call_guard<nb::gil_scoped_release>())
      .def("native_all_gather", [](MpiComm& c, uintptr_t out, uintptr_t in, int64_t count, int dtype, int device,
                                   uintptr_t stream, bool polled) {
        c.native_all_gather(ptr(out), ptr(in), count, static_cast<DType>(dtype), c.memory(device, ptr(stream)),
                            polled);
      }, nb::arg("out"), nb::arg("in"), nb::arg("count"), nb::arg("dtype"), nb::arg("device"), nb::arg("stream"),
         nb::arg("polled") = false, nb::call_guard<nb::gil_scoped_release>())
      .def("native_reduce_scatter", [](MpiComm& c, uintptr_t out, uintptr_t in, int64_t count, int dtype, int op,
                                       int device, uintptr_t stream, bool polled) {
        c.native_reduce_scatter(ptr(out), ptr(in), count, static_cast<DType>(dtype), static_cast<Op>(op),
                                c.memory(device, ptr(stream)), polled);
      }, nb::arg("out"), nb::arg("in"), nb::arg("count"), nb::arg("dtype"), nb::arg("op"), nb::arg("device"),
         nb::arg("stream"), nb::arg("polled") = false, nb::call_guard<nb::gil_scoped_release>())
      .def("native_all_reduce", [](MpiComm& c, uintptr_t buf, int64_t count, int dtype, int op, int device,
                                   uintptr_t stream, bool polled) {
        c.native_all_reduce(ptr(buf), count, static_cast<DType>(dtype), static_cast<Op>(op),
                            c.memory(device, ptr(stream)), polled);
      }, nb::arg("buf"), nb::arg("count"), nb::arg("dtype"), nb::arg("op"), nb::arg("device"), nb::arg("stream"),
         nb::arg("polled") = false, nb::call_guard<nb::gil_scoped_release>())
      .def("native_broadcast", [](MpiComm& c, uintptr_t buf, int64_t count, int dtype, int root, int device,
                                  uintptr_t stream, bool polled) {
        c.native_broadcast(ptr(buf), count, static_cast<DType>(dtype), root, c.memory(device, ptr(stream)), polled);
      }, nb::arg("buf"), nb::arg("count"), nb::arg("dtype"), nb::arg("root"), nb::arg("device"), nb::arg("stream"),
         nb::arg("polled") = false, nb::call_guard<nb::gil_scoped_release>())
      .def("native_barrier", [](MpiComm& c, bool polled) { c.native_barrier(polled); },
           nb::arg("polled") = false, nb::call_guard<nb::gil_scoped_release>());
}
