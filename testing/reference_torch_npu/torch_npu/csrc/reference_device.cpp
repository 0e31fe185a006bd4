// The reference torch_npu's "npu" device: torch's PrivateUse1 backend over host memory.
//
// Tests only. Tensors on "npu:N" own host memory obtained through the allocator below,
// which accounts every byte against the modelled NPU N (allocated, reserved = cached,
// peaks; out of memory past TORCH_NPU_REFERENCE_TOTAL_MEMORY). Kernels: the factories,
// copies and storage-changing ops are written here; every other op goes through a boxed
// fallback that runs torch's CPU kernel on host views of the npu tensors (same memory, no
// copy), so in-place and view ops act on the npu memory itself, and fresh results are
// copied into new npu memory. Mixing an npu tensor with a CPU tensor of one or more
// dimensions, or npu tensors of two devices, fails as on a real device.
//
// Built on first import by torch.utils.cpp_extension.load (torch_npu/_device_ext.py).

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace reference_npu {

constexpr c10::DeviceType kNpu = c10::DeviceType::PrivateUse1;

// --- the modelled machine (environment variables, read at each call, as in _config.py) ---

int64_t env_int(const char* name, int64_t fallback) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || std::string(raw).find_first_not_of(" \t") == std::string::npos) {
    return fallback;
  }
  char* end = nullptr;
  long long value = std::strtoll(raw, &end, 10);
  TORCH_CHECK_VALUE(end != raw && *end == '\0' && value >= 0, name, "=", raw,
                    " is not a non-negative integer.");
  return value;
}

int64_t device_count() {
  const char* visible = std::getenv("ASCEND_RT_VISIBLE_DEVICES");
  if (visible != nullptr) {
    std::string ids(visible);
    if (ids.find_first_not_of(" \t") == std::string::npos) {
      return 0;
    }
    int64_t count = 1;
    for (char c : ids) {
      count += c == ',' ? 1 : 0;
    }
    return count;
  }
  return env_int("TORCH_NPU_REFERENCE_DEVICE_COUNT", 1);
}

int64_t total_memory() {
  return env_int("TORCH_NPU_REFERENCE_TOTAL_MEMORY", int64_t(64) << 30);
}

std::atomic<bool> enabled{false};

void check_enabled() {
  TORCH_CHECK(enabled.load(),
              "The reference torch_npu was uninstalled (torch_npu._reference.uninstall()); "
              "import torch_npu again before creating tensors on the 'npu' device.");
}

thread_local c10::DeviceIndex current_index = 0;

c10::DeviceIndex checked_index(c10::DeviceIndex index) {
  if (index < 0) {
    index = current_index;
  }
  int64_t count = device_count();
  TORCH_CHECK(index < count, "Invalid npu device index ", int(index), ": this process sees ",
              count, " NPU(s) (ASCEND_RT_VISIBLE_DEVICES / TORCH_NPU_REFERENCE_DEVICE_COUNT).");
  return index;
}

// --- memory accounting: a modelled caching allocator fed by real allocations -------------

struct Stats {
  int64_t allocated = 0;
  int64_t reserved = 0;
  int64_t peak_allocated = 0;
  int64_t peak_reserved = 0;
};

std::mutex stats_mutex;
std::unordered_map<int, Stats> stats;
uint64_t generation = 0;  // reset_accounting() starts a new one; older frees are not counted

uint64_t account_allocate(int device, int64_t nbytes) {
  std::lock_guard<std::mutex> lock(stats_mutex);
  Stats& s = stats[device];
  int64_t allocated = s.allocated + nbytes;
  int64_t reserved = std::max(s.reserved, allocated);
  int64_t total = total_memory();
  TORCH_CHECK_WITH(OutOfMemoryError, reserved <= total, "NPU out of memory. Tried to allocate ",
                   nbytes, " bytes on npu:", device, "; ", s.allocated, " of ", total,
                   " bytes are allocated and ", s.reserved, " reserved.");
  s.allocated = allocated;
  s.reserved = reserved;
  s.peak_allocated = std::max(s.peak_allocated, allocated);
  s.peak_reserved = std::max(s.peak_reserved, reserved);
  return generation;
}

void account_free(int device, int64_t nbytes, uint64_t of_generation) {
  std::lock_guard<std::mutex> lock(stats_mutex);
  if (of_generation != generation) {
    return;
  }
  Stats& s = stats[device];
  s.allocated = std::max<int64_t>(0, s.allocated - nbytes);
}

struct Allocation {
  void* data;
  int64_t nbytes;
  int device;
  uint64_t generation;
};

void free_allocation(void* context) {
  auto* allocation = static_cast<Allocation*>(context);
  c10::free_cpu(allocation->data);
  account_free(allocation->device, allocation->nbytes, allocation->generation);
  delete allocation;
}

c10::DataPtr allocate_on(c10::DeviceIndex index, size_t nbytes) {
  check_enabled();
  index = checked_index(index);
  uint64_t of_generation = account_allocate(index, static_cast<int64_t>(nbytes));
  void* data = nullptr;
  if (nbytes > 0) {
    try {
      data = c10::alloc_cpu(nbytes);
    } catch (...) {
      account_free(index, static_cast<int64_t>(nbytes), of_generation);
      throw;
    }
  }
  auto* allocation = new Allocation{data, static_cast<int64_t>(nbytes), index, of_generation};
  return {data, allocation, &free_allocation, c10::Device(kNpu, index)};
}

// Cached, unallocated bytes go back to the device: reserved falls to allocated on every NPU.
void release_cached_blocks() {
  std::lock_guard<std::mutex> lock(stats_mutex);
  for (auto& entry : stats) {
    entry.second.reserved = entry.second.allocated;
  }
}

// A DeviceAllocator, as torch_npu's caching allocator is, so that torch's device-generic
// calls (torch.accelerator.empty_cache / memory_allocated / get_memory_info, ...) reach the
// same accounting as torch.npu's functions.
struct NpuAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    return allocate_on(current_index, nbytes);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool initialized() override {
    return true;
  }
  void emptyCache(c10::MempoolId_t mempool_id) override {
    TORCH_CHECK_VALUE(mempool_id == c10::MempoolId_t(0, 0),
                      "The reference npu allocator has no private memory pools; empty_cache "
                      "takes the default pool (0, 0), got (", mempool_id.first, ", ",
                      mempool_id.second, ").");
    release_cached_blocks();
  }
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    // Every op completes when issued: no allocation outlives its last use on a stream.
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    int index = checked_index(device);
    std::lock_guard<std::mutex> lock(stats_mutex);
    const Stats& s = stats[index];
    c10::CachingDeviceAllocator::DeviceStats out;
    for (auto* stat : {&out.allocated_bytes, &out.active_bytes, &out.requested_bytes}) {
      (*stat)[0].current = s.allocated;
      (*stat)[0].peak = s.peak_allocated;
    }
    out.reserved_bytes[0].current = s.reserved;
    out.reserved_bytes[0].peak = s.peak_reserved;
    return out;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    checked_index(device);  // nothing accumulated beyond the current and peak numbers
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    int index = checked_index(device);
    std::lock_guard<std::mutex> lock(stats_mutex);
    Stats& s = stats[index];
    s.peak_allocated = s.allocated;
    s.peak_reserved = s.reserved;
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    int index = checked_index(device);
    std::lock_guard<std::mutex> lock(stats_mutex);
    int64_t total = total_memory();
    return {static_cast<size_t>(total - stats[index].reserved), static_cast<size_t>(total)};
  }
};

NpuAllocator npu_allocator;

// Pinned host memory: plain host memory whose ranges are remembered, so is_pinned() holds.
std::mutex pinned_mutex;
std::map<uintptr_t, size_t> pinned_ranges;

void free_pinned(void* data) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned_ranges.erase(reinterpret_cast<uintptr_t>(data));
  }
  c10::free_cpu(data);
}

// torch's host allocator for the npu device type (torch.accelerator.empty_host_cache and the
// host-memory stats reach it): it caches nothing, every block goes back to the system at once.
struct PinnedAllocator final : at::HostAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = c10::alloc_cpu(nbytes == 0 ? 1 : nbytes);
    {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned_ranges[reinterpret_cast<uintptr_t>(data)] = nbytes;
    }
    return {data, data, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &free_pinned;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  // The device works synchronously: a block is free for reuse as soon as it is released.
  bool record_event(void*, void*, c10::Stream) override {
    return true;
  }
  void empty_cache() override {}
  at::HostStats get_stats() override {  // torch exposes host stats to Python for CUDA only
    return {};
  }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};

PinnedAllocator pinned_allocator;

bool is_pinned_ptr(const void* data) {
  auto address = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(pinned_mutex);
  auto it = pinned_ranges.upper_bound(address);
  if (it == pinned_ranges.begin()) {
    return false;
  }
  --it;
  return address < it->first + std::max<size_t>(it->second, 1);
}

// --- device guard: current device per thread; one stream queue, synchronous work --------

std::atomic<int64_t> next_stream_id{1};
thread_local std::unordered_map<int, c10::StreamId> current_streams;
int event_marker = 0;

struct NpuGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kNpu;
  }
  c10::Device exchangeDevice(c10::Device device) const override {
    c10::Device previous = getDevice();
    setDevice(device);
    return previous;
  }
  c10::Device getDevice() const override {
    return {kNpu, current_index};
  }
  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.type() == kNpu, "Expected an npu device, got ", device);
    current_index = checked_index(device.index());
  }
  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0) {
      current_index = device.index();
    }
  }
  c10::Stream getStream(c10::Device device) const override {
    auto it = current_streams.find(device.index());
    c10::StreamId id = it == current_streams.end() ? 0 : it->second;
    return c10::Stream(c10::Stream::UNSAFE, device, id);
  }
  c10::Stream getDefaultStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device device, bool) const override {
    return c10::Stream(c10::Stream::UNSAFE, device, next_stream_id++);
  }
  c10::Stream getNewStream(c10::Device device, int) const override {
    return c10::Stream(c10::Stream::UNSAFE, device, next_stream_id++);
  }
  c10::Stream exchangeStream(c10::Stream stream) const override {
    c10::Stream previous = getStream(stream.device());
    current_streams[stream.device_index()] = stream.id();
    return previous;
  }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void** event, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    *event = &event_marker;  // work is done when issued: the event completes at once
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override {
    return true;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    try {
      return static_cast<c10::DeviceIndex>(device_count());
    } catch (...) {
      return 0;
    }
  }
  bool queryStream(const c10::Stream&) const override {
    return true;
  }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override {
    TORCH_CHECK(false, "elapsed time of npu events: use torch.npu.Event, which times them.");
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NpuGuardImpl);

// --- storage helpers ----------------------------------------------------------------------

void release_storage_reference(void* context) {
  delete static_cast<c10::Storage*>(context);
}

// A CPU tensor over the same memory as npu tensor `t` (same sizes, strides, offset). Its
// storage keeps t's storage alive; if a CPU kernel resizes it, it gets its own memory,
// which the caller copies back.
at::Tensor host_view(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != kNpu) {
    return t;
  }
  const c10::Storage& storage = t.storage();
  void* data = storage.unsafeGetStorageImpl()->mutable_data();
  c10::DataPtr alias(data, new c10::Storage(storage), &release_storage_reference,
                     c10::Device(c10::DeviceType::CPU));
  auto impl = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(),
                                                    storage.nbytes(), std::move(alias),
                                                    c10::GetCPUAllocator(), true);
  at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(std::move(impl)), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  view.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(),
                                                    t.storage_offset());
  view._set_conj(t.is_conj());
  view._set_neg(t.is_neg());
  return view;
}

// An npu tensor over `storage` with the metadata of `like`.
at::Tensor npu_tensor_over(const c10::Storage& storage, const at::Tensor& like) {
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), like.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                   like.storage_offset());
  out._set_conj(like.is_conj());
  out._set_neg(like.is_neg());
  return out;
}

// New npu memory on `device` holding a copy of CPU tensor `t`'s whole storage.
at::Tensor npu_copy_of(const at::Tensor& t, c10::Device device) {
  size_t nbytes = t.storage().nbytes();
  c10::DataPtr data = allocate_on(device.index(), nbytes);
  if (nbytes > 0) {
    std::memcpy(data.get(), t.storage().data(), nbytes);
  }
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), &npu_allocator,
                       true);
  return npu_tensor_over(storage, t);
}

// Grow (never shrink) an npu storage to `nbytes`, keeping its contents.
void grow_storage(c10::StorageImpl* storage, size_t nbytes) {
  if (nbytes <= storage->nbytes()) {
    return;
  }
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  c10::DataPtr grown = allocate_on(storage->device().index(), nbytes);
  if (storage->nbytes() > 0) {
    std::memcpy(grown.get(), storage->data(), storage->nbytes());
  }
  storage->set_data_ptr_noswap(std::move(grown));
  storage->set_nbytes(nbytes);
}

// --- kernels -------------------------------------------------------------------------------

c10::Device npu_device(std::optional<c10::Device> device) {
  c10::Device d = device.value_or(c10::Device(kNpu, current_index));
  TORCH_CHECK(d.type() == kNpu, "Expected an npu device, got ", d);
  return c10::Device(kNpu, checked_index(d.index()));
}

void check_dense(std::optional<c10::Layout> layout, std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "The reference npu device holds strided (dense) tensors only, got layout ",
              c10::layout_or_default(layout));
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory),
              "Only dense CPU tensors can be pinned");
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout,
                               std::optional<c10::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  check_dense(layout, pin_memory);
  c10::DeviceGuard guard(npu_device(device));
  return at::detail::empty_generic(size, &npu_allocator,
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  check_dense(layout, pin_memory);
  c10::DeviceGuard guard(npu_device(device));
  return at::detail::empty_strided_generic(size, stride, &npu_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

void check_copy_devices(const at::Tensor& src, const at::Tensor& dst) {
  for (const at::Tensor* t : {&src, &dst}) {
    TORCH_CHECK(t->device().type() == kNpu || t->device().type() == c10::DeviceType::CPU,
                "The reference npu device copies between npu and cpu tensors only, got ",
                t->device());
  }
}

at::Tensor& copy_(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  check_copy_devices(src, self);
  at::Tensor dst_host = host_view(self);
  dst_host.copy_(host_view(src), non_blocking);
  return self;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  check_copy_devices(self, dst);
  at::Tensor dst_host = host_view(dst);
  dst_host.copy_(host_view(self), non_blocking);
  return dst;
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (memory_format.has_value()) {
    TORCH_CHECK(*memory_format != c10::MemoryFormat::Preserve,
                "Unsupported memory format Preserve");
    impl->empty_tensor_restride(*memory_format);
  }
  size_t needed = at::detail::computeStorageNbytes(self.sizes(), self.strides(),
                                                   self.dtype().itemsize(),
                                                   self.storage_offset());
  grow_storage(self.storage().unsafeGetStorageImpl(), needed);
  return self;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Tensor& set_source_storage_offset(at::Tensor& self, c10::Storage source,
                                      int64_t storage_offset, c10::IntArrayRef size,
                                      c10::IntArrayRef stride) {
  TORCH_CHECK(source.device().type() == kNpu,
              "set_: expected a storage on the npu device, got one on ", source.device());
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(storage_offset);
  if (stride.data() == nullptr) {
    impl->set_sizes_contiguous(size);
  } else {
    impl->set_sizes_and_strides(size, stride);
  }
  size_t needed = at::detail::computeStorageNbytes(self.sizes(), self.strides(),
                                                   self.dtype().itemsize(), storage_offset);
  grow_storage(self.storage().unsafeGetStorageImpl(), needed);
  return self;
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0,
                       allocate_on(self.device().index(), 0), &npu_allocator, true);
  return set_source_storage_offset(self, storage, 0, {0}, {});
}

void record_stream(at::Tensor&, c10::Stream) {}

// --- the fallback: torch's CPU kernel on host views ---------------------------------------

[[noreturn]] void device_mismatch(c10::Device a, c10::Device b, const std::string& argument,
                                  const c10::OperatorName& op) {
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two "
                     "devices, ", a, " and ", b, "! (when checking argument for argument ",
              argument, " in method ", op, ")");
}

bool takes_host_indices(const c10::OperatorName& op) {
  // As on CUDA, index and index_put_ take their indices from the host too.
  return op.name == "aten::index" || op.name == "aten::index_put_" ||
         op.name == "aten::index_put" || op.name == "aten::_index_put_impl_";
}

struct Mapped {
  at::Tensor npu;
  at::Tensor host;
  const c10::StorageImpl* host_storage;
  const void* host_data;
  size_t host_nbytes;
  bool written;
};

void npu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  const size_t first = stack->size() - arguments.size();

  // Which npu device the op runs on; refuse tensors of another device.
  std::optional<c10::Device> target;
  std::optional<std::pair<std::string, c10::Device>> host_tensor;
  auto look = [&](const at::Tensor& t, const std::string& name, bool host_ok) {
    if (!t.defined()) {
      return;
    }
    if (t.device().type() == kNpu) {
      if (!target) {
        target = t.device();
      } else if (*target != t.device()) {
        device_mismatch(*target, t.device(), name, schema.operator_name());
      }
    } else if (!(t.device().type() == c10::DeviceType::CPU && (t.dim() == 0 || host_ok))) {
      if (!host_tensor) {
        host_tensor = std::make_pair(name, t.device());
      }
    }
  };
  const bool host_indices = takes_host_indices(schema.operator_name());
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& value = (*stack)[first + i];
    const std::string& name = arguments[i].name();
    if (value.isTensor()) {
      look(value.toTensor(), name, false);
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList()) {
        look(t, name, false);
      }
    } else if (value.isList()) {
      for (const c10::IValue& item : value.toListRef()) {
        if (item.isTensor()) {
          look(item.toTensor(), name, host_indices && name == "indices");
        }
      }
    } else if (value.isDevice() && value.toDevice().type() == kNpu) {
      c10::Device d(kNpu, checked_index(value.toDevice().index()));
      if (!target) {
        target = d;
      }
    }
  }
  if (target && host_tensor) {
    device_mismatch(*target, host_tensor->second, host_tensor->first, schema.operator_name());
  }

  // Replace npu tensors (and npu devices) by their host views.
  std::vector<Mapped> mapped;
  std::unordered_set<const c10::TensorImpl*> host_inputs;
  auto to_host = [&](const at::Tensor& t, bool written) -> at::Tensor {
    if (!t.defined() || t.device().type() != kNpu) {
      if (t.defined()) {
        host_inputs.insert(t.unsafeGetTensorImpl());
      }
      return t;
    }
    at::Tensor host = host_view(t);
    mapped.push_back({t, host, host.storage().unsafeGetStorageImpl(), host.storage().data(),
                      host.storage().nbytes(), written});
    return host;
  };
  for (size_t i = 0; i < arguments.size(); ++i) {
    c10::IValue& value = (*stack)[first + i];
    const auto* alias = arguments[i].alias_info();
    const bool written = alias != nullptr && alias->isWrite();
    if (value.isTensor()) {
      value = to_host(value.toTensor(), written);
    } else if (value.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : value.toTensorList()) {
        list.push_back(to_host(t, written));
      }
      value = list;
    } else if (value.isList() && value.toListRef().size() > 0 &&
               value.toList().elementType()->kind() == c10::TypeKind::OptionalType) {
      c10::List<std::optional<at::Tensor>> list;
      for (const c10::IValue& item : value.toListRef()) {
        list.push_back(item.isTensor() ? std::optional<at::Tensor>(to_host(item.toTensor(),
                                                                          written))
                                       : std::nullopt);
      }
      value = list;
    } else if (value.isDevice() && value.toDevice().type() == kNpu) {
      value = c10::Device(c10::DeviceType::CPU);
    }
  }

  op.callBoxed(stack);

  // Written arguments: bring back storage growth and metadata changes made on the host view.
  for (Mapped& m : mapped) {
    if (!m.written) {
      continue;
    }
    const c10::Storage& host_storage = m.host.storage();
    c10::StorageImpl* npu_storage = m.npu.storage().unsafeGetStorageImpl();
    if (host_storage.data() != m.host_data || host_storage.nbytes() != m.host_nbytes) {
      size_t nbytes = host_storage.nbytes();
      c10::DataPtr data = allocate_on(m.npu.device().index(), nbytes);
      if (nbytes > 0) {
        std::memcpy(data.get(), host_storage.data(), nbytes);
      }
      npu_storage->set_data_ptr_noswap(std::move(data));
      npu_storage->set_nbytes(nbytes);
    }
    if (m.host.sizes() != m.npu.sizes() || m.host.strides() != m.npu.strides() ||
        m.host.storage_offset() != m.npu.storage_offset()) {
      m.npu.unsafeGetTensorImpl()->set_sizes_and_strides(m.host.sizes(), m.host.strides(),
                                                         m.host.storage_offset());
    }
  }

  // Results: an argument's host view becomes the argument, a view of one becomes an npu
  // view of its storage, a fresh host result is copied into new npu memory.
  auto to_npu = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined() || t.device().type() != c10::DeviceType::CPU ||
        host_inputs.count(t.unsafeGetTensorImpl()) > 0) {
      return t;
    }
    for (const Mapped& m : mapped) {
      if (t.unsafeGetTensorImpl() == m.host.unsafeGetTensorImpl()) {
        return m.npu;
      }
    }
    for (const Mapped& m : mapped) {
      if (t.storage().unsafeGetStorageImpl() == m.host_storage) {
        return npu_tensor_over(m.npu.storage(), t);
      }
    }
    if (!target) {
      return t;
    }
    return npu_copy_of(t, *target);
  };
  const size_t returns = schema.returns().size();
  for (size_t i = stack->size() - returns; i < stack->size(); ++i) {
    c10::IValue& value = (*stack)[i];
    if (value.isTensor()) {
      value = to_npu(value.toTensor());
    } else if (value.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : value.toTensorList()) {
        list.push_back(to_npu(t));
      }
      value = list;
    }
  }
}

// --- hooks: pinned memory, generators, device queries --------------------------------------

struct NpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return device_count() > 0;
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override {
    return at::detail::createCPUGenerator();
  }
  c10::Device getDeviceFromPtr(void*) const override {
    return {kNpu, current_index};
  }
  bool isPinnedPtr(const void* data) const override {
    return is_pinned_ptr(data);
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    return &pinned_allocator;
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override {
    return true;
  }
  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(device_count());
  }
  void setCurrentDevice(c10::DeviceIndex device) const override {
    current_index = checked_index(device);
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return current_index;
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    c10::DeviceIndex previous = current_index;
    current_index = checked_index(device);
    return previous;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    c10::DataPtr data = allocate_on(impl->device().index(), nbytes);
    size_t kept = std::min(nbytes, impl->nbytes());
    if (kept > 0) {
      std::memcpy(data.get(), impl->data(), kept);
    }
    impl->set_data_ptr_noswap(std::move(data));
    impl->set_nbytes(nbytes);
  }
};

// --- Python-facing controls ---------------------------------------------------------------

std::tuple<int64_t, int64_t, int64_t, int64_t> memory_stats(int64_t device) {
  std::lock_guard<std::mutex> lock(stats_mutex);
  const Stats& s = stats[static_cast<int>(device)];
  return {s.allocated, s.reserved, s.peak_allocated, s.peak_reserved};
}

void simulate_allocation(int64_t device, int64_t nbytes) {
  account_allocate(static_cast<int>(device), nbytes);
}

void simulate_free(int64_t device, int64_t nbytes) {
  std::lock_guard<std::mutex> lock(stats_mutex);
  Stats& s = stats[static_cast<int>(device)];
  TORCH_CHECK_VALUE(0 <= nbytes && nbytes <= s.allocated, "Cannot free ", nbytes, " bytes: ",
                    s.allocated, " bytes are allocated on this NPU.");
  s.allocated -= nbytes;
}

void reset_peaks(int64_t device, bool reserved_too) {
  std::lock_guard<std::mutex> lock(stats_mutex);
  Stats& s = stats[static_cast<int>(device)];
  s.peak_allocated = s.allocated;
  if (reserved_too) {
    s.peak_reserved = s.reserved;
  }
}

void empty_cache() {
  release_cached_blocks();
}

void reset_accounting() {
  std::lock_guard<std::mutex> lock(stats_mutex);
  stats.clear();
  ++generation;
}

void set_enabled(bool on) {
  enabled = on;
}

int64_t get_current_device() {
  return current_index;
}

void set_current_device(int64_t index) {
  current_index = static_cast<c10::DeviceIndex>(index);  // torch_npu.npu validated it
}

bool register_hooks() {
  static NpuHooks* hooks = [] {
    auto* h = new NpuHooks();
    at::RegisterPrivateUse1HooksInterface(h);
    return h;
  }();
  return hooks != nullptr;
}

}  // namespace reference_npu

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace reference_npu;
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("copy_", TORCH_FN(copy_));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_source_storage_offset));
  m.impl("set_", TORCH_FN(set_empty));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("record_stream", TORCH_FN(record_stream));
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&reference_npu::npu_fallback>());
}

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &reference_npu::npu_allocator);
REGISTER_HOST_ALLOCATOR(c10::DeviceType::PrivateUse1, &reference_npu::pinned_allocator);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  using namespace reference_npu;
  module.def("host_view", &host_view, "A CPU tensor over an npu tensor's memory.");
  module.def("memory_stats", &memory_stats);
  module.def("simulate_allocation", &simulate_allocation);
  module.def("simulate_free", &simulate_free);
  module.def("reset_peaks", &reset_peaks);
  module.def("empty_cache", &empty_cache);
  module.def("reset_accounting", &reset_accounting);
  module.def("set_enabled", &set_enabled);
  module.def("current_device", &get_current_device);
  module.def("set_current_device", &set_current_device);
  module.def("register_hooks", &register_hooks);
  module.def("is_pinned_ptr", [](int64_t address) {
    return is_pinned_ptr(reinterpret_cast<const void*>(address));
  });
}
