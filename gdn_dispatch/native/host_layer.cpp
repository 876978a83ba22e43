// gdn_dispatch's native host layer (gdn_dispatch/native/__init__.py builds and loads it).
//
// GuardedLauncher: a kept kernel's straight-line launcher in C++, what the generated Python launchers of
// gdn_dispatch.backends.gluon_common.launch.fast_launcher and
// gdn_dispatch.backends.direct_launch.fast_launcher do, with the tensor reads done on
// at::Tensor instead of through torch's Python attributes.
//
// A GuardedLauncher holds, per argument of one launch site, the value class the kept
// kernel was compiled for (Triton's specialization: a tensor's dtype and 16-byte
// alignment, an integer's == 1 / % 16 / int32 classes, a bool's or None's value, a float's
// or str's type, a constexpr's value) and where the argument goes in the C launch's list;
// per TMA descriptor, the tensor it views and its column count. A call checks every
// argument against its class and returns False at the first difference (nothing
// launched: the caller then binds as usual), else fills the argument list and calls
// Triton's C launch. Anything it does not handle itself (a descriptor over a tensor that is
// not whole contiguous rows, an integer outside int64) also returns False or goes through
// the Python helper named for it, so the Python path stays the one that raises.
#include <torch/extension.h>
#include <torch/csrc/Dtype.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <cstdint>
#include <string>
#include <vector>

namespace {

// What the host benchmarks read (benchmarks/host_parts.py): how often a descriptor was
// reused as it was, found among the encoded ones, or encoded; and, while timing is on, the
// call programs' nanoseconds per phase (checks and launcher lookup, allocation, argument
// lists, launches) summed over calls.
struct Stats {
  int64_t desc_reused = 0, desc_found = 0, desc_encoded = 0, programs = 0;
  int64_t ns[4] = {0, 0, 0, 0};
  bool timing = false;
};
Stats g_stats;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

py::dict stats() {
  py::dict out;
  out["desc_reused"] = g_stats.desc_reused;
  out["desc_found"] = g_stats.desc_found;
  out["desc_encoded"] = g_stats.desc_encoded;
  out["programs"] = g_stats.programs;
  out["ns_checks"] = g_stats.ns[0];
  out["ns_allocate"] = g_stats.ns[1];
  out["ns_arguments"] = g_stats.ns[2];
  out["ns_launches"] = g_stats.ns[3];
  return out;
}

void reset_stats(bool timing) {
  g_stats = Stats();
  g_stats.timing = timing;
}

enum class Kind : int { Tensor = 0, Int = 1, Identity = 2, Type = 3, Equal = 4 };

struct Arg {
  Kind kind;
  py::object key;       // the argument's name in the call's dict
  int slot;             // index into the launch's argument list (-1: checked, not passed)
  at::ScalarType dtype = at::ScalarType::Undefined;
  bool aligned = false;  // Tensor: data_ptr() % 16 == 0
  bool specialized = false, is_one = false, div16 = false, int32 = false;  // Int
  py::object expected;  // Identity: the object; Type: the type; Equal: the constexpr value
};

struct Desc {
  py::object key;    // the tensor's name in the call's tensor dict
  int slot;          // the descriptor's first slot (map, rows, cols, stride, 1)
  int64_t cols;
  at::ScalarType dtype;
  bool whole_rows;   // the plan's shape[0] is None: rows = numel / cols when contiguous
  py::object view;   // DescPlan.view_of, for every other layout
  py::object maps;   // dict (ptr, rows, stride) -> encoded map, shared with the Python path
  py::object encode; // the kernel's TMA encoder
  py::object cols_obj, one;  // the constant slots, made once
  // The last view seen and its slots' objects: a call whose tensor lies where the last
  // one did (the caching allocator hands the same blocks back) reuses them as they are.
  std::uintptr_t last_ptr = 0;
  int64_t last_rows = -1, last_stride = -1;
  py::object last_map, last_rows_obj, last_stride_obj;
};

// One launch argument's value: a Python object, or a tensor a call program holds in C++
// (its intermediates, which never become Python objects).
struct Value {
  PyObject* obj = nullptr;
  const at::Tensor* tensor = nullptr;
};

at::ScalarType scalar_type_of(const py::handle& dtype) {
  if (!THPDtype_Check(dtype.ptr())) throw std::invalid_argument("expected a torch.dtype");
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

class GuardedLauncher {
 public:
  GuardedLauncher(py::object c_launch, py::tuple prefix, py::list template_args, py::object device,
                  py::object options, py::object encode_kept, int count)
      : c_launch_(std::move(c_launch)), prefix_(std::move(prefix)), device_(std::move(device)),
        options_(std::move(options)), encode_kept_(std::move(encode_kept)), count_(count) {
    for (auto item : template_args) template_.push_back(py::reinterpret_borrow<py::object>(item));
  }

  void add_tensor(py::object key, int slot, py::handle dtype, bool aligned) {
    Arg a{Kind::Tensor, std::move(key), slot};
    a.dtype = scalar_type_of(dtype);
    a.aligned = aligned;
    args_.push_back(std::move(a));
  }

  void add_int(py::object key, int slot, bool specialized, bool is_one, bool div16, bool int32) {
    Arg a{Kind::Int, std::move(key), slot};
    a.specialized = specialized;
    a.is_one = is_one;
    a.div16 = div16;
    a.int32 = int32;
    args_.push_back(std::move(a));
  }

  void add_object(py::object key, int slot, int kind, py::object expected) {
    if (kind != static_cast<int>(Kind::Identity) && kind != static_cast<int>(Kind::Type) &&
        kind != static_cast<int>(Kind::Equal))
      throw std::invalid_argument("add_object: kind must be Identity, Type or Equal");
    Arg a{static_cast<Kind>(kind), std::move(key), slot};
    a.expected = std::move(expected);
    args_.push_back(std::move(a));
  }

  void add_descriptor(py::object key, int slot, int64_t cols, py::handle dtype, bool whole_rows, py::object view,
                      py::object maps, py::object encode) {
    Desc d{std::move(key), slot, cols, scalar_type_of(dtype), whole_rows, std::move(view), std::move(maps),
           std::move(encode)};
    d.cols_obj = py::int_(cols);
    d.one = py::int_(1);
    descs_.push_back(std::move(d));
  }

  // (device, args, tensors, g0, g1, g2, stream[, options]) -> bool
  bool call(py::handle device, py::handle args, py::handle tensors, py::handle g0, py::handle g1, py::handle g2,
            py::handle stream, py::handle options) {
    py::tuple out;
    if (!prepare(device, args, tensors, g0, g1, g2, stream, options, &out)) return false;
    fire(out);
    return true;
  }

  // The checks and the argument list of call() without the launch: false (nothing
  // filled) at the first difference, else the C launch's arguments in *out. A call
  // program checks every launch of a call this way before it launches any.
  bool prepare(py::handle device, py::handle args, py::handle tensors, py::handle g0, py::handle g1, py::handle g2,
               py::handle stream, py::handle options, py::tuple* launch_args) {
    PyObject* arg_dict = args.ptr();
    if (!PyDict_Check(arg_dict) || PyDict_GET_SIZE(arg_dict) != count_) return false;
    PyObject* tensor_dict = tensors.ptr();
    if (!descs_.empty() && !PyDict_Check(tensor_dict)) return false;
    auto lookup = [](PyObject* dict, const py::object& key) -> PyObject* {
      PyObject* v = PyDict_GetItemWithError(dict, key.ptr());  // borrowed
      if (v == nullptr && PyErr_Occurred()) throw py::error_already_set();
      return v;
    };
    return prepare_with([&](size_t, const Arg& a) { return Value{lookup(arg_dict, a.key)}; },
                        [&](size_t, const Desc& d) { return Value{lookup(tensor_dict, d.key)}; }, device, g0, g1,
                        g2, stream, options, launch_args);
  }

  // prepare() with the argument values read by position: arg_at(i, arg) and desc_at(j,
  // desc) give the i-th argument's and j-th descriptor's Value (a borrowed object or a
  // tensor; neither: the call lacks it, and nothing is launched).
  template <typename ArgAt, typename DescAt>
  bool prepare_with(ArgAt arg_at, DescAt desc_at, py::handle device, py::handle g0, py::handle g1, py::handle g2,
                    py::handle stream, py::handle options, py::tuple* launch_args) {
    if (!same(device, device_)) return false;
    if (!options_.is_none() && !same(options, options_)) return false;
    const size_t n_prefix = PyTuple_GET_SIZE(prefix_.ptr());
    const size_t n_args = template_.size();
    py::tuple out(4 + n_prefix + n_args);
    std::vector<py::object> filled(template_);
    for (size_t i = 0; i < args_.size(); ++i) {
      const Arg& a = args_[i];
      const Value got = arg_at(i, a);
      PyObject* v = got.obj;
      if (v == nullptr && (got.tensor == nullptr || a.kind != Kind::Tensor)) return false;
      py::object value;
      switch (a.kind) {
        case Kind::Tensor: {
          if (got.tensor == nullptr && !THPVariable_Check(v)) return false;
          const at::Tensor& t = got.tensor != nullptr ? *got.tensor : THPVariable_Unpack(v);
          if (t.scalar_type() != a.dtype) return false;
          auto ptr = reinterpret_cast<std::uintptr_t>(t.data_ptr());
          if ((ptr % 16 == 0) != a.aligned) return false;
          value = py::reinterpret_steal<py::object>(PyLong_FromUnsignedLongLong(ptr));
          break;
        }
        case Kind::Int: {
          if (!PyLong_CheckExact(v)) return false;
          int overflow = 0;
          long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
          if (overflow != 0) return false;
          if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
          if (a.specialized && (((x == 1) != a.is_one) || ((x % 16 == 0) != a.div16))) return false;
          if ((x >= INT32_MIN && x <= INT32_MAX) != a.int32) return false;
          value = py::reinterpret_borrow<py::object>(v);
          break;
        }
        case Kind::Identity:
          if (v != a.expected.ptr()) return false;
          value = py::reinterpret_borrow<py::object>(v);
          break;
        case Kind::Type:
          if (reinterpret_cast<PyObject*>(Py_TYPE(v)) != a.expected.ptr()) return false;
          value = py::reinterpret_borrow<py::object>(v);
          break;
        case Kind::Equal: {
          int eq = PyObject_RichCompareBool(v, a.expected.ptr(), Py_EQ);
          if (eq < 0) throw py::error_already_set();
          if (eq == 0) return false;
          value = py::reinterpret_borrow<py::object>(v);
          break;
        }
      }
      if (a.slot >= 0) filled[a.slot] = std::move(value);
    }
    for (size_t j = 0; j < descs_.size(); ++j) {
      Desc& d = descs_[j];
      const Value got = desc_at(j, d);
      PyObject* v = got.obj;
      if (got.tensor == nullptr && (v == nullptr || !THPVariable_Check(v))) return false;
      const at::Tensor& t = got.tensor != nullptr ? *got.tensor : THPVariable_Unpack(v);
      int64_t rows, stride;
      int64_t numel = t.numel();
      if (d.whole_rows && t.scalar_type() == d.dtype && numel % d.cols == 0 && t.is_contiguous()) {
        rows = numel / d.cols;
        stride = d.cols;
      } else {
        // Other layouts, and every error: the plan's own reading (it raises what it raises).
        py::object tensor = got.tensor != nullptr ? py::reinterpret_steal<py::object>(THPVariable_Wrap(t))
                                                  : py::reinterpret_borrow<py::object>(v);
        py::tuple view = d.view(tensor);
        rows = view[0].cast<py::tuple>()[0].cast<int64_t>();
        stride = view[1].cast<py::tuple>()[0].cast<int64_t>();
      }
      auto ptr = reinterpret_cast<std::uintptr_t>(t.data_ptr());
      if (d.last_map && ptr == d.last_ptr && rows == d.last_rows && stride == d.last_stride) {
        ++g_stats.desc_reused;
      } else {
        py::object p = py::reinterpret_steal<py::object>(PyLong_FromUnsignedLongLong(ptr));
        py::object r = py::int_(rows), s = py::int_(stride);
        py::tuple key = py::make_tuple(p, r, s);
        PyObject* map = PyDict_GetItemWithError(d.maps.ptr(), key.ptr());
        py::object tma;
        if (map != nullptr) {
          ++g_stats.desc_found;
          tma = py::reinterpret_borrow<py::object>(map);
        } else {
          if (PyErr_Occurred()) throw py::error_already_set();
          ++g_stats.desc_encoded;
          tma = encode_kept_(d.maps, d.encode, p, r, d.cols_obj, s);
        }
        d.last_map = std::move(tma);
        d.last_ptr = ptr;
        d.last_rows = rows;
        d.last_stride = stride;
        d.last_rows_obj = std::move(r);
        d.last_stride_obj = std::move(s);
      }
      filled[d.slot] = d.last_map;
      filled[d.slot + 1] = d.last_rows_obj;
      filled[d.slot + 2] = d.cols_obj;
      filled[d.slot + 3] = d.last_stride_obj;
      filled[d.slot + 4] = d.one;
    }
    size_t i = 0;
    for (py::handle h : {g0, g1, g2, stream}) out[i++] = py::reinterpret_borrow<py::object>(h);
    for (size_t j = 0; j < n_prefix; ++j) out[i++] = prefix_[j];
    for (auto& value : filled) out[i++] = std::move(value);
    *launch_args = std::move(out);
    return true;
  }

  // The argument and descriptor names, in the order prepare_with() reads them, and how
  // many arguments a call passes.
  std::vector<py::object> arg_keys() const {
    std::vector<py::object> keys;
    for (const Arg& a : args_) keys.push_back(a.key);
    return keys;
  }
  std::vector<py::object> desc_keys() const {
    std::vector<py::object> keys;
    for (const Desc& d : descs_) keys.push_back(d.key);
    return keys;
  }
  int count() const { return count_; }

  void fire(const py::tuple& launch_args) {
    PyObject* result = PyObject_Call(c_launch_.ptr(), launch_args.ptr(), nullptr);
    if (result == nullptr) throw py::error_already_set();
    Py_DECREF(result);
  }

 private:
  static bool same(py::handle a, const py::object& b) {
    if (a.ptr() == b.ptr()) return true;
    int eq = PyObject_RichCompareBool(a.ptr(), b.ptr(), Py_EQ);
    if (eq < 0) throw py::error_already_set();
    return eq == 1;
  }

  py::object c_launch_;
  py::tuple prefix_;
  py::object device_, options_, encode_kept_;
  int count_;
  std::vector<py::object> template_;
  std::vector<Arg> args_;
  std::vector<Desc> descs_;
};

// The outputs of one launch sequence, allocated in one call: each tensor's dims are
// constants or one of the call's six sizes (a dim of -1 ... -6 reads size 0 ... 5), its
// dtype a fixed one or the like tensor's. at::empty from C++ skips torch's Python argument
// parser: on the H200's host five allocations took 24.8 us from Python, 10.7 from here.
// Specs of one group (a third spec entry >= 0) are carved from one allocation, each at a
// 256-byte boundary (a contiguous view of its own dtype): a call's intermediates, which
// all live exactly as long as the call, take one allocation and one free instead of one
// each.
class Allocator {
 public:
  static constexpr int kSizes = 6;
  static constexpr int64_t kAlign = 256;

  explicit Allocator(py::list specs) {
    for (auto item : specs) {
      auto spec = item.cast<py::tuple>();
      Spec s;
      for (auto d : spec[0].cast<py::tuple>()) {
        s.dims.push_back(d.cast<int64_t>());
        if (s.dims.back() < -kSizes) throw std::invalid_argument("Allocator: a dim below -6");
      }
      s.same_dtype = spec[1].is_none();
      if (!s.same_dtype) s.dtype = scalar_type_of(spec[1]);
      if (spec.size() > 2 && !spec[2].is_none()) {
        s.group = spec[2].cast<int>();
        if (s.group < 0 || s.group > 7) throw std::invalid_argument("Allocator: groups 0 to 7");
        groups_ = std::max(groups_, s.group + 1);
      }
      specs_.push_back(std::move(s));
    }
  }

  py::tuple call(py::handle like, int64_t a, int64_t b, int64_t c, int64_t d, int64_t e, int64_t f) {
    if (!THPVariable_Check(like.ptr())) throw std::invalid_argument("Allocator: like must be a Tensor");
    const int64_t sizes[kSizes] = {a, b, c, d, e, f};
    std::vector<at::Tensor> made = allocate(THPVariable_Unpack(like.ptr()), sizes);
    py::tuple out(made.size());
    for (size_t i = 0; i < made.size(); ++i)
      out[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(made[i])));
    return out;
  }

  // The tensors of every spec, for sizes[0..5], on t's device.
  std::vector<at::Tensor> allocate(const at::Tensor& t, const int64_t* sizes) const {
    const size_t n = specs_.size();
    std::vector<std::vector<int64_t>> dims(n);
    std::vector<at::ScalarType> dtypes(n);
    std::vector<int64_t> offsets(n, 0);
    int64_t totals[8] = {0};
    for (size_t i = 0; i < n; ++i) {
      const Spec& s = specs_[i];
      int64_t numel = 1;
      for (int64_t dim : s.dims) {
        dims[i].push_back(dim >= 0 ? dim : sizes[-dim - 1]);
        numel *= dims[i].back();
      }
      dtypes[i] = s.same_dtype ? t.scalar_type() : s.dtype;
      if (s.group >= 0) {
        offsets[i] = totals[s.group];
        const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtypes[i]));
        totals[s.group] += (bytes + kAlign - 1) / kAlign * kAlign;
      }
    }
    std::vector<at::Tensor> bases(groups_);
    for (size_t i = 0; i < n; ++i) {
      const int g = specs_[i].group;
      if (g >= 0 && !bases[g].defined()) bases[g] = at::empty({totals[g]}, t.options().dtype(at::kByte));
    }
    std::vector<at::Tensor> out(n);
    std::vector<int64_t> strides;
    for (size_t i = 0; i < n; ++i) {
      const Spec& s = specs_[i];
      auto options = t.options().dtype(dtypes[i]);
      at::Tensor& made = out[i];
      if (s.group < 0) {
        made = at::empty(dims[i], options);
      } else {
        const int64_t item = static_cast<int64_t>(c10::elementSize(dtypes[i]));
        strides.assign(dims[i].size(), 1);
        for (int64_t k = static_cast<int64_t>(dims[i].size()) - 2; k >= 0; --k)
          strides[k] = strides[k + 1] * std::max<int64_t>(dims[i][k + 1], 1);
        // A tensor over the group's storage, made as at::empty makes its own (no dispatcher
        // round trip, which costs more than the allocation on a host's CPU tensors).
        const at::Tensor& base = bases[s.group];
        made = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(),
                                                        c10::scalarTypeToTypeMeta(dtypes[i]));
        made.unsafeGetTensorImpl()->set_sizes_and_strides(dims[i], strides, offsets[i] / item);
      }
    }
    return out;
  }

 private:
  struct Spec {
    std::vector<int64_t> dims;
    bool same_dtype = true;
    at::ScalarType dtype = at::ScalarType::Undefined;
    int group = -1;
  };
  std::vector<Spec> specs_;
  int groups_ = 0;

 public:
  int size() const { return static_cast<int>(specs_.size()); }
};

// The contract's checks (gdn_dispatch.contract.make_problem) for the common call, on
// at::Tensor: contiguous q, k, v, g, beta on one device; cu_seqlens None or a contiguous
// device index tensor, its host copy None or a contiguous CPU index tensor; initial_state
// None or a contiguous float tensor of the call's state shape, or with state_indices (a
// contiguous device index tensor [N]) a float32 or bfloat16 state pool [P >= 1, ...].
// Returns what the contract computes of such a call, (B, T, H, K, HV, V, N, longest,
// aligned) (longest and aligned None without a host copy), or None for every call it does
// not accept as valid (another form, or a broken rule): the Python contract then decides
// and raises with its message. It never raises for a bad input itself.
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kChunkSize = 64;

// A torch.Tensor or nn.Parameter, no other subclass: a subclass (fake, functional, wrapper)
// may answer sizes or data from Python, which the contract's Python checks read as it means.
bool is_tensor(py::handle h) { return THPVariable_CheckExact(h.ptr()); }

bool qkv_dtype(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat;
}

bool float_dtype(at::ScalarType t) { return qkv_dtype(t) || t == at::kDouble; }

bool index_dtype(at::ScalarType t) { return t == at::kInt || t == at::kLong; }

template <typename T>
bool read_offsets(const at::Tensor& cpu, int64_t T_total, int64_t* longest, bool* aligned) {
  const T* values = cpu.data_ptr<T>();
  const int64_t n = cpu.numel();
  if (n < 2 || values[0] != 0 || static_cast<int64_t>(values[n - 1]) != T_total) return false;
  int64_t previous = 0, best = 0, misaligned = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t value = static_cast<int64_t>(values[i]);
    const int64_t length = value - previous;
    if (length < 0) return false;
    if (length > best) best = length;
    misaligned |= value % kChunkSize;
    previous = value;
  }
  *longest = best;
  *aligned = misaligned == 0;
  return true;
}

py::object admit(py::handle q_h, py::handle k_h, py::handle v_h, py::handle g_h, py::handle beta_h,
                 py::handle state_h, py::handle cu_h, py::handle cu_cpu_h, bool vk, py::handle indices_h) {
  const py::object refuse = py::none();
  for (py::handle h : {q_h, k_h, v_h, g_h, beta_h})
    if (!is_tensor(h)) return refuse;
  const at::Tensor& q = THPVariable_Unpack(q_h.ptr());
  const at::Tensor& k = THPVariable_Unpack(k_h.ptr());
  const at::Tensor& v = THPVariable_Unpack(v_h.ptr());
  const at::Tensor& g = THPVariable_Unpack(g_h.ptr());
  const at::Tensor& beta = THPVariable_Unpack(beta_h.ptr());
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || g.dim() != 3 || beta.dim() != 3) return refuse;
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  const int64_t HV = v.size(2), V = v.size(3);
  if (k.sizes() != q.sizes() || v.size(0) != B || v.size(1) != T) return refuse;
  for (const at::Tensor* t : {&g, &beta})
    if (t->size(0) != B || t->size(1) != T || t->size(2) != HV) return refuse;
  if (H == 0 || HV % H != 0 || K < 1 || K > kMaxHeadDim || V < 1 || V > kMaxHeadDim) return refuse;
  const at::ScalarType dtype = q.scalar_type();
  if (!qkv_dtype(dtype) || k.scalar_type() != dtype || v.scalar_type() != dtype) return refuse;
  if (!float_dtype(g.scalar_type()) || !float_dtype(beta.scalar_type())) return refuse;
  const at::Device device = q.device();
  for (const at::Tensor* t : {&k, &v, &g, &beta})
    if (t->device() != device) return refuse;
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta})
    if (!t->is_contiguous()) return refuse;

  int64_t N = B;
  py::object longest = py::none(), aligned = py::none();
  if (!cu_h.is_none()) {
    if (!is_tensor(cu_h) || B != 1) return refuse;
    const at::Tensor& cu = THPVariable_Unpack(cu_h.ptr());
    if (cu.dim() != 1 || !index_dtype(cu.scalar_type()) || cu.device() != device || cu.size(0) < 2 ||
        !cu.is_contiguous())
      return refuse;
    N = cu.size(0) - 1;
    if (!cu_cpu_h.is_none()) {
      if (!is_tensor(cu_cpu_h)) return refuse;
      const at::Tensor& cpu = THPVariable_Unpack(cu_cpu_h.ptr());
      if (cpu.dim() != 1 || !index_dtype(cpu.scalar_type()) || !cpu.device().is_cpu() || !cpu.is_contiguous() ||
          cpu.numel() != cu.numel())
        return refuse;
      int64_t best = 0;
      bool whole = false;
      const bool ok = cpu.scalar_type() == at::kInt ? read_offsets<int32_t>(cpu, T, &best, &whole)
                                                    : read_offsets<int64_t>(cpu, T, &best, &whole);
      if (!ok) return refuse;
      longest = py::int_(best);
      aligned = py::bool_(whole);
    }
  } else if (!cu_cpu_h.is_none()) {
    return refuse;
  }

  // A state pool: one contiguous index per sequence on the call's device, and the pool
  // [P >= 1, HV, ...] in float32 or bfloat16.
  const bool pool = !indices_h.is_none();
  if (pool) {
    if (!is_tensor(indices_h) || state_h.is_none()) return refuse;
    const at::Tensor& idx = THPVariable_Unpack(indices_h.ptr());
    if (idx.dim() != 1 || !index_dtype(idx.scalar_type()) || idx.device() != device || idx.size(0) != N ||
        !idx.is_contiguous())
      return refuse;
  }
  if (!state_h.is_none()) {
    if (!is_tensor(state_h)) return refuse;
    const at::Tensor& s = THPVariable_Unpack(state_h.ptr());
    if (s.dim() != 4 || !float_dtype(s.scalar_type()) || s.device() != device || !s.is_contiguous()) return refuse;
    const int64_t inner0 = vk ? V : K, inner1 = vk ? K : V;
    if (s.size(1) != HV || s.size(2) != inner0 || s.size(3) != inner1) return refuse;
    if (pool ? (s.size(0) < 1 || (s.scalar_type() != at::kFloat && s.scalar_type() != at::kBFloat16))
             : s.size(0) != N)
      return refuse;
  }
  return py::make_tuple(B, T, H, K, HV, V, N, longest, aligned);
}

// gdn_dispatch.backends.gluon_common.launch_plan.tma_rows_reason's test for contiguous
// tensors [B, T, ...]: a 16-byte-aligned base and token rows a multiple of 16 bytes. True
// when every tensor passes; False for any other (then the Python check decides: it also
// reads token rows in place, and says why not).
bool tma_rows_tensor(py::handle h) {
  if (!is_tensor(h)) return false;
  const at::Tensor& t = THPVariable_Unpack(h.ptr());
  if (t.dim() < 2 || !t.is_contiguous()) return false;
  if (reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  int64_t row = 1;
  for (int64_t d = 2; d < t.dim(); ++d) row *= t.size(d);
  return row * static_cast<int64_t>(t.element_size()) % 16 == 0;
}

bool tma_rows_ok(py::tuple tensors) {
  for (py::handle h : tensors)
    if (!tma_rows_tensor(h)) return false;
  return true;
}


// A call program: one call's allocations and launches, planned once per call form
// (gdn_dispatch.backends.call_program and the backends' call_program modules build it from
// the stage wrappers' own argument lists), run in one C++ call. Each launch argument is
// bound to where its value comes from in the call: one of its inputs, one of the buffers it
// allocates, one of its counts, a constant, its scale, or one entry of a buffer's first
// dim. Every launch goes through the GuardedLauncher its launch site used last (the "fast"
// entry of the site's dict), whose checks all pass before the first launch: a call that any
// of them refuses launches nothing and returns None (the Python path then runs it, binding
// as usual). The buffers stay C++ tensors: a call returns only its outputs (o and the final
// state) as Python objects.
enum class Source : int { Input = 0, Buffer = 1, Count = 2, Constant = 3, Scale = 4, Item = 5 };

struct Bound {
  py::object key;
  Source source;
  int index;
  py::object value;  // Constant: the value; Item: which entry of the buffer's first dim
};

struct Step {
  py::object compiled;  // a dict whose "fast" entry is the launch site's GuardedLauncher
  py::object options;   // the launch options its launcher was made for (None: none)
  std::vector<Bound> args, tensors;
  int64_t row_block, per_seq, times, minimum, more0, more1;
  bool ceil;
  int rows_count, seqs_count;  // indices into the call's counts; -1: 0
  // For the launcher last seen (held alive here): the binding of each of its arguments and
  // descriptors, in its order.
  py::object layout_owner;
  std::vector<int> arg_index, desc_index;
};

std::vector<Bound> bounds_of(py::list items) {
  std::vector<Bound> out;
  for (auto item : items) {
    auto t = item.cast<py::tuple>();
    int source = t[1].cast<int>();
    if (source < 0 || source > static_cast<int>(Source::Item)) throw std::invalid_argument("CallProgram: bad source");
    out.push_back(Bound{py::reinterpret_borrow<py::object>(t[0]), static_cast<Source>(source), t[2].cast<int>(),
                        py::reinterpret_borrow<py::object>(t[3])});
  }
  return out;
}

class CallProgram {
 public:
  CallProgram(py::list specs, std::vector<int> tma_inputs, std::vector<int> row_inputs, int state_input,
              std::vector<int> outputs)
      : alloc_(std::move(specs)), tma_inputs_(std::move(tma_inputs)), row_inputs_(std::move(row_inputs)),
        state_input_(state_input), outputs_(std::move(outputs)), fast_key_(py::str("fast")) {
    for (int i : outputs_)
      if (i < 0 || i >= alloc_.size()) throw std::invalid_argument("CallProgram: no such output buffer");
    // The inputs the checks read, like those the bindings read, are counted in
    // inputs_needed_, which each call's input tuple must cover.
    for (const std::vector<int>* checked : {&tma_inputs_, &row_inputs_}) {
      for (int i : *checked) {
        if (i < 0) throw std::invalid_argument("CallProgram: no such input");
        inputs_needed_ = std::max(inputs_needed_, i + 1);
      }
    }
    inputs_needed_ = std::max(inputs_needed_, state_input_ + 1);
  }

  // grid: (row_block, ceil, per_seq, times, minimum, more0, more1): grid[0] = max(minimum,
  // counts[rows_count] / row_block (ceil: rounded up) + counts[seqs_count] * per_seq) * times.
  void add_step(py::object compiled, py::list args, py::list tensors, py::tuple grid, int rows_count,
                int seqs_count, py::object options) {
    if (!PyDict_Check(compiled.ptr())) throw std::invalid_argument("CallProgram: compiled must be a dict");
    Step s;
    s.compiled = std::move(compiled);
    s.options = std::move(options);
    s.args = bounds_of(args);
    s.tensors = bounds_of(tensors);
    for (const std::vector<Bound>* bounds : {&s.args, &s.tensors}) {
      for (const Bound& b : *bounds) {
        if (b.source == Source::Buffer || b.source == Source::Item) {
          if (b.index < 0 || b.index >= alloc_.size()) throw std::invalid_argument("CallProgram: no such buffer");
        } else if (b.source == Source::Input) {
          if (b.index < 0) throw std::invalid_argument("CallProgram: no such input");
          inputs_needed_ = std::max(inputs_needed_, b.index + 1);
        } else if (b.source == Source::Count) {
          if (b.index < 0) throw std::invalid_argument("CallProgram: no such count");
          counts_needed_ = std::max(counts_needed_, b.index + 1);
        }
      }
    }
    counts_needed_ = std::max({counts_needed_, rows_count + 1, seqs_count + 1});
    s.row_block = grid[0].cast<int64_t>();
    s.ceil = grid[1].cast<bool>();
    s.per_seq = grid[2].cast<int64_t>();
    s.times = grid[3].cast<int64_t>();
    s.minimum = grid[4].cast<int64_t>();
    s.more0 = grid[5].cast<int64_t>();
    s.more1 = grid[6].cast<int64_t>();
    s.rows_count = rows_count;
    s.seqs_count = seqs_count;
    steps_.push_back(std::move(s));
  }

  // inputs: the call's tensors (and None) as the bindings index them; sizes: the
  // allocator's six; counts: the ints the launches read (and size their grids from).
  // launch=false does everything but the launches (what a host benchmark subtracts).
  // Returns the buffers named in outputs, in that order, or None.
  py::object run(py::tuple inputs, std::vector<int64_t> sizes, std::vector<int64_t> counts, py::object scale,
                 py::handle device, py::handle stream, bool launch) {
    const py::object refuse = py::none();
    const bool timing = g_stats.timing;
    int64_t t0 = timing ? now_ns() : 0;
    if (sizes.size() != Allocator::kSizes) throw std::invalid_argument("CallProgram.run: six sizes");
    if (static_cast<int>(inputs.size()) < inputs_needed_ || static_cast<int>(counts.size()) < counts_needed_)
      throw std::invalid_argument("CallProgram.run: fewer inputs or counts than the program reads");
    for (int i : tma_inputs_)
      if (!tma_rows_tensor(inputs[i])) return refuse;
    for (int i : row_inputs_) {
      if (!is_tensor(inputs[i])) return refuse;
      if (!THPVariable_Unpack(inputs[i].ptr()).is_contiguous()) return refuse;
    }
    if (state_input_ >= 0 && !inputs[state_input_].is_none()) {
      if (!is_tensor(inputs[state_input_])) return refuse;
      const at::Tensor& s = THPVariable_Unpack(inputs[state_input_].ptr());
      // Read in place by the kernels: float32 or bfloat16, contiguous (others are converted first).
      if (!s.is_contiguous() || (s.scalar_type() != at::kFloat && s.scalar_type() != at::kBFloat16)) return refuse;
    }
    // Every launch site's launcher first: a site without one (a plan's first call, or a
    // launcher made while the layer was off) refuses the call before anything is allocated.
    std::vector<GuardedLauncher*> launchers;
    std::vector<py::object> held;  // the launchers, alive while this call uses them
    for (const Step& s : steps_) {
      PyObject* fast = PyDict_GetItemWithError(s.compiled.ptr(), fast_key_.ptr());
      if (fast == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        return refuse;
      }
      py::handle fast_h(fast);
      if (!py::isinstance<GuardedLauncher>(fast_h)) return refuse;
      held.push_back(py::reinterpret_borrow<py::object>(fast_h));
      launchers.push_back(fast_h.cast<GuardedLauncher*>());
    }
    auto lap = [&](int phase) {
      if (!timing) return;
      const int64_t t = now_ns();
      g_stats.ns[phase] += t - t0;
      t0 = t;
    };
    lap(0);
    if (!is_tensor(inputs[0])) return refuse;
    // The buffers stay C++ tensors (launch arguments read them as such); only the outputs
    // become Python objects, after the launches.
    const std::vector<at::Tensor> buffers = alloc_.allocate(THPVariable_Unpack(inputs[0].ptr()), sizes.data());
    lap(1);
    std::vector<py::object> count_objs;
    for (int64_t c : counts) count_objs.push_back(py::int_(c));
    std::vector<py::tuple> prepared;
    std::vector<Value> arg_values, desc_values;
    std::deque<at::Tensor> made;  // tensors this call makes for its arguments (buffer entries); stable addresses
    for (size_t i = 0; i < steps_.size(); ++i) {
      Step& s = steps_[i];
      GuardedLauncher* launcher = launchers[i];
      if (!(s.layout_owner && s.layout_owner.ptr() == held[i].ptr()) && !lay_out(s, *launcher, held[i])) return refuse;
      resolve(s.args, inputs, buffers, count_objs, scale, &arg_values, &made);
      resolve(s.tensors, inputs, buffers, count_objs, scale, &desc_values, &made);
      const int64_t rows = s.rows_count < 0 ? 0 : counts[s.rows_count];
      const int64_t seqs = s.seqs_count < 0 ? 0 : counts[s.seqs_count];
      int64_t units = 0;
      if (s.row_block) units = s.ceil ? (rows + s.row_block - 1) / s.row_block : rows / s.row_block;
      const int64_t g0 = std::max(s.minimum, units + seqs * s.per_seq) * s.times;
      py::tuple launch_args;
      if (!launcher->prepare_with([&](size_t k, const auto&) { return arg_values[s.arg_index[k]]; },
                                  [&](size_t k, const auto&) { return desc_values[s.desc_index[k]]; }, device,
                                  py::int_(g0), py::int_(s.more0), py::int_(s.more1), stream, s.options,
                                  &launch_args))
        return refuse;
      prepared.push_back(std::move(launch_args));
    }
    lap(2);
    if (launch)
      for (size_t i = 0; i < launchers.size(); ++i) launchers[i]->fire(prepared[i]);
    py::tuple out(outputs_.size());
    for (size_t i = 0; i < outputs_.size(); ++i)
      out[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(buffers[outputs_[i]]));
    lap(3);
    ++g_stats.programs;
    return std::move(out);
  }

 private:
  // Which of the step's bindings feeds each argument and descriptor of ``launcher``, in
  // the order it reads them (kept with the launcher object, which stays alive while it is
  // kept here); false where its names are not the step's (then the call is refused).
  static bool lay_out(Step& s, const GuardedLauncher& launcher, const py::object& owner) {
    auto index_of = [](const std::vector<Bound>& bounds, const std::vector<py::object>& keys,
                       std::vector<int>* out) {
      out->clear();
      for (const py::object& key : keys) {
        int found = -1;
        for (size_t b = 0; b < bounds.size() && found < 0; ++b) {
          int eq = PyObject_RichCompareBool(bounds[b].key.ptr(), key.ptr(), Py_EQ);
          if (eq < 0) throw py::error_already_set();
          if (eq) found = static_cast<int>(b);
        }
        if (found < 0) return false;
        out->push_back(found);
      }
      return true;
    };
    s.layout_owner = py::object();
    if (launcher.count() != static_cast<int>(s.args.size()) || !index_of(s.args, launcher.arg_keys(), &s.arg_index) ||
        !index_of(s.tensors, launcher.desc_keys(), &s.desc_index))
      return false;
    s.layout_owner = owner;
    return true;
  }

  // Each binding's value for this call (a borrowed object, or a tensor of buffers or kept
  // in *made).
  static void resolve(const std::vector<Bound>& bounds, const py::tuple& inputs,
                      const std::vector<at::Tensor>& buffers, const std::vector<py::object>& counts,
                      const py::object& scale, std::vector<Value>* out, std::deque<at::Tensor>* made) {
    out->clear();
    for (const Bound& b : bounds) {
      switch (b.source) {
        case Source::Item:
          made->push_back(buffers[b.index].select(0, b.value.cast<int64_t>()));
          out->push_back(Value{nullptr, &made->back()});
          break;
        case Source::Input: out->push_back(Value{PyTuple_GET_ITEM(inputs.ptr(), b.index)}); break;
        case Source::Buffer: out->push_back(Value{nullptr, &buffers[b.index]}); break;
        case Source::Count: out->push_back(Value{counts.at(b.index).ptr()}); break;
        case Source::Constant: out->push_back(Value{b.value.ptr()}); break;
        case Source::Scale: out->push_back(Value{scale.ptr()}); break;
      }
    }
  }

  Allocator alloc_;
  int inputs_needed_ = 0, counts_needed_ = 0;
  std::vector<int> tma_inputs_, row_inputs_;
  int state_input_;
  std::vector<int> outputs_;
  py::str fast_key_;
  std::vector<Step> steps_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gdn_dispatch's native host layer: guarded launchers, one-call allocators, the call's checks";
  m.attr("KIND_IDENTITY") = static_cast<int>(Kind::Identity);
  m.attr("KIND_TYPE") = static_cast<int>(Kind::Type);
  m.attr("KIND_EQUAL") = static_cast<int>(Kind::Equal);
  py::class_<GuardedLauncher>(m, "GuardedLauncher")
      .def(py::init<py::object, py::tuple, py::list, py::object, py::object, py::object, int>(),
           py::arg("c_launch"), py::arg("prefix"), py::arg("template"), py::arg("device"), py::arg("options"),
           py::arg("encode_kept"), py::arg("count"))
      .def("add_tensor", &GuardedLauncher::add_tensor)
      .def("add_int", &GuardedLauncher::add_int)
      .def("add_object", &GuardedLauncher::add_object)
      .def("add_descriptor", &GuardedLauncher::add_descriptor)
      .def("__call__", &GuardedLauncher::call, py::arg("device"), py::arg("args"), py::arg("tensors"),
           py::arg("g0"), py::arg("g1"), py::arg("g2"), py::arg("stream"), py::arg("options") = py::none());
  m.def("admit", &admit, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"),
        py::arg("initial_state"), py::arg("cu_seqlens"), py::arg("cu_seqlens_cpu"), py::arg("vk"),
        py::arg("state_indices") = py::none());
  m.def("tma_rows_ok", &tma_rows_ok, py::arg("tensors"));
  m.def("stats", &stats);
  m.def("reset_stats", &reset_stats, py::arg("timing") = false);
  py::class_<Allocator>(m, "Allocator")
      .def(py::init<py::list>(), py::arg("specs"))
      .def("__call__", &Allocator::call, py::arg("like"), py::arg("a"), py::arg("b") = 0, py::arg("c") = 0,
           py::arg("d") = 0, py::arg("e") = 0, py::arg("f") = 0);
  m.attr("SOURCE_INPUT") = static_cast<int>(Source::Input);
  m.attr("SOURCE_BUFFER") = static_cast<int>(Source::Buffer);
  m.attr("SOURCE_COUNT") = static_cast<int>(Source::Count);
  m.attr("SOURCE_CONSTANT") = static_cast<int>(Source::Constant);
  m.attr("SOURCE_SCALE") = static_cast<int>(Source::Scale);
  m.attr("SOURCE_ITEM") = static_cast<int>(Source::Item);
  py::class_<CallProgram>(m, "CallProgram")
      .def(py::init<py::list, std::vector<int>, std::vector<int>, int, std::vector<int>>(), py::arg("specs"),
           py::arg("tma_inputs"), py::arg("row_inputs"), py::arg("state_input"), py::arg("outputs"))
      .def("add_step", &CallProgram::add_step, py::arg("compiled"), py::arg("args"), py::arg("tensors"),
           py::arg("grid"), py::arg("rows_count"), py::arg("seqs_count"), py::arg("options") = py::none())
      .def("__call__", &CallProgram::run, py::arg("inputs"), py::arg("sizes"), py::arg("counts"), py::arg("scale"),
           py::arg("device"), py::arg("stream"), py::arg("launch") = true);
}
