// The cuDNN frontend is used in dynamic-loading mode: every cuDNN call goes through dlsym on the
// handle opened here, so no binary of flamia links libcudnn.
#include "cudnn_sdpa.h"

#include <dlfcn.h>

#include <cudnn_frontend.h>
#include <algorithm>
#include <mutex>
#include <unordered_map>

#include "flamia/common.h"

namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;  // read by the frontend's shim
}

namespace flamia::bench {
namespace fe = cudnn_frontend;

namespace {

constexpr const char* kCudnnLibrary = "libcudnn.so.9";

struct CudnnState {
  std::string error;
  cudnnHandle_t handle = nullptr;
};

CudnnState& state() {
  static CudnnState s;
  static std::once_flag once;
  std::call_once(once, [] {
    fe::cudnn_dlhandle = dlopen(kCudnnLibrary, RTLD_NOW | RTLD_GLOBAL);
    if (fe::cudnn_dlhandle == nullptr) {
      const char* e = dlerror();
      s.error = std::string("cannot load ") + kCudnnLibrary + ": " + (e ? e : "unknown error");
      return;
    }
    if (fe::detail::create_handle(&s.handle) != CUDNN_STATUS_SUCCESS)
      s.error = "cudnnCreate failed";
  });
  return s;
}

// Tensor uids of the variant pack.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
  kSeqLen,
  kRaggedQ,
  kRaggedKV,
  kDescaleQ,
  kDescaleK,
  kDescaleV,
  kDescaleO,
  kDescaleDO,
  kDescaleS,
  kScaleS,
  kDescaleDP,
  kScaleDP,
  kScaleO,
  kScaleDQ,
  kScaleDK,
  kScaleDV,
  kAmaxS,
  kAmaxO,
  kAmaxDQ,
  kAmaxDK,
  kAmaxDV,
  kAmaxDP,
};

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

struct Geometry {
  int64_t batch, max_len, hq, hkv, dim, tokens;
  CudnnLayout layout;

  std::vector<int64_t> dims(int64_t heads) const { return {batch, heads, max_len, dim}; }
  // BSHD: tokens of a document contiguous, heads interleaved per token.
  std::vector<int64_t> strides(int64_t heads) const {
    return {max_len * heads * dim, dim, heads * dim, 1};
  }
};

void check(fe::error_t e, const char* what) {
  if (!e.is_good()) throw Error(std::string("cuDNN ") + what + ": " + e.get_message());
}

}  // namespace

std::string cudnn_status() {
  return state().error;
}

std::string cudnn_version() {
  if (!state().error.empty()) return "unavailable";
  return fe::detail::get_backend_version_string();
}

struct CudnnSdpa::Impl {
  CudnnLayout layout;
  CudnnPrecision precision;
  cudaStream_t stream;
  fe::graph::Graph fwd, bwd;
  int64_t workspace = 0;

  // The variant pack of the forward or the backward graph: exactly the tensors it declares.
  std::unordered_map<int64_t, void*> pack(const SdpaBuffers& b, bool forward) const {
    std::unordered_map<int64_t, void*> m = {{kQ, b.q}, {kK, b.k},         {kV, b.v},
                                            {kO, b.o}, {kStats, b.stats}, {kSeqLen, b.seq_len}};
    if (layout == CudnnLayout::kRagged) {
      m[kRaggedQ] = b.ragged_q;
      m[kRaggedKV] = b.ragged_kv;
    }
    if (!forward) {
      m[kDO] = b.dout;
      m[kDQ] = b.dq;
      m[kDK] = b.dk;
      m[kDV] = b.dv;
    }
    if (precision != CudnnPrecision::kFp8) return m;
    m[kDescaleQ] = b.descale_q;
    m[kDescaleK] = b.descale_k;
    m[kDescaleV] = b.descale_v;
    m[kDescaleS] = b.descale_s;
    m[kScaleS] = b.scale_s;
    if (forward) {
      m[kScaleO] = b.scale_o;
      m[kAmaxS] = b.amax + 0;
      m[kAmaxO] = b.amax + 1;
      return m;
    }
    m[kDescaleO] = b.descale_o;
    m[kDescaleDO] = b.descale_do;
    m[kDescaleDP] = b.descale_dp;
    m[kScaleDP] = b.scale_dp;
    m[kScaleDQ] = b.scale_dq;
    m[kScaleDK] = b.scale_dk;
    m[kScaleDV] = b.scale_dv;
    m[kAmaxDQ] = b.amax + 2;
    m[kAmaxDK] = b.amax + 3;
    m[kAmaxDV] = b.amax + 4;
    m[kAmaxDP] = b.amax + 5;
    return m;
  }
};

namespace {

// Builds one graph: the common tensors, then `body` adds the operation and its outputs.
template <typename Body>
void build_graph(fe::graph::Graph& g, const Geometry& geo, CudnnPrecision precision,
                 cudnnHandle_t handle, Body body) {
  const fe::DataType_t io =
      precision == CudnnPrecision::kFp8 ? fe::DataType_t::FP8_E4M3 : fe::DataType_t::BFLOAT16;
  g.set_io_data_type(io)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  body(g, io);
  check(g.validate(), "validate");
  check(g.build_operation_graph(handle), "build_operation_graph");
  check(g.create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans");
  check(g.check_support(handle), "check_support");
  check(g.build_plans(handle), "build_plans");
}

struct Inputs {
  TensorPtr seq_len, ragged_q, ragged_kv;
};

TensorPtr data_tensor(fe::graph::Graph& g, const Geometry& geo, const char* name, Uid uid,
                      int64_t heads, fe::DataType_t type, const Inputs& in, bool kv) {
  auto t = g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim(geo.dims(heads))
                        .set_stride(geo.strides(heads))
                        .set_data_type(type));
  if (geo.layout == CudnnLayout::kRagged) t->set_ragged_offset(kv ? in.ragged_kv : in.ragged_q);
  return t;
}

void as_output(const TensorPtr& t, const Geometry& geo, Uid uid, int64_t heads, fe::DataType_t type,
               const Inputs& in, bool kv) {
  t->set_output(true)
      .set_uid(uid)
      .set_dim(geo.dims(heads))
      .set_stride(geo.strides(heads))
      .set_data_type(type);
  if (geo.layout == CudnnLayout::kRagged) t->set_ragged_offset(kv ? in.ragged_kv : in.ragged_q);
}

Inputs common_inputs(fe::graph::Graph& g, const Geometry& geo) {
  Inputs in;
  in.seq_len = g.tensor(fe::graph::Tensor_attributes()
                            .set_name("seq_len")
                            .set_uid(kSeqLen)
                            .set_dim({geo.batch, 1, 1, 1})
                            .set_stride({1, 1, 1, 1})
                            .set_data_type(fe::DataType_t::INT32));
  if (geo.layout == CudnnLayout::kRagged) {
    auto offsets = [&](const char* name, Uid uid) {
      return g.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({geo.batch + 1, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(fe::DataType_t::INT64));
    };
    in.ragged_q = offsets("ragged_q", kRaggedQ);
    in.ragged_kv = offsets("ragged_kv", kRaggedKV);
  }
  return in;
}

TensorPtr scalar(fe::graph::Graph& g, const char* name, Uid uid) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({1, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::FLOAT));
}

void as_scalar_output(const TensorPtr& t, Uid uid) {
  t->set_output(true)
      .set_uid(uid)
      .set_dim({1, 1, 1, 1})
      .set_stride({1, 1, 1, 1})
      .set_data_type(fe::DataType_t::FLOAT);
}

void set_stats(const TensorPtr& t, const Geometry& geo, bool output) {
  if (output) t->set_output(true);
  t->set_uid(kStats)
      .set_dim({geo.batch, geo.hq, geo.max_len, 1})
      .set_stride({geo.hq * geo.max_len, geo.max_len, 1, 1})
      .set_data_type(fe::DataType_t::FLOAT);
}

}  // namespace

CudnnSdpa::CudnnSdpa(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudnnSdpa::~CudnnSdpa() = default;
CudnnLayout CudnnSdpa::layout() const {
  return impl_->layout;
}
size_t CudnnSdpa::workspace_bytes() const {
  return size_t(impl_->workspace);
}

std::unique_ptr<CudnnSdpa> CudnnSdpa::build(const SdpaProblem& p, CudnnPrecision precision,
                                            CudnnLayout layout, cudaStream_t stream,
                                            std::string* reason) {
  CudnnState& s = state();
  if (!s.error.empty()) {
    *reason = s.error;
    return nullptr;
  }
  auto impl = std::make_unique<Impl>();
  impl->layout = layout;
  impl->precision = precision;
  impl->stream = stream;
  const Geometry geo{
      int64_t(p.docs.size()), p.max_len(), p.heads_q, p.heads_kv, p.dim, p.tokens(), layout};
  const bool fp8 = precision == CudnnPrecision::kFp8;
  try {
    if (fe::detail::set_stream(s.handle, stream) != CUDNN_STATUS_SUCCESS)
      throw Error("cudnnSetStream failed");
    build_graph(impl->fwd, geo, precision, s.handle, [&](fe::graph::Graph& g, fe::DataType_t io) {
      const Inputs in = common_inputs(g, geo);
      auto q = data_tensor(g, geo, "Q", kQ, geo.hq, io, in, false);
      auto k = data_tensor(g, geo, "K", kK, geo.hkv, io, in, true);
      auto v = data_tensor(g, geo, "V", kV, geo.hkv, io, in, true);
      auto attrs = fe::graph::SDPA_attributes()
                       .set_name("sdpa_forward")
                       .set_generate_stats(true)
                       .set_attn_scale(p.softmax_scale)
                       .set_causal_mask(p.causal)
                       .set_padding_mask(true)
                       .set_seq_len_q(in.seq_len)
                       .set_seq_len_kv(in.seq_len);
      TensorPtr o, stats;
      if (fp8) {
        auto outs = g.sdpa_fp8(q, k, v, scalar(g, "descale_q", kDescaleQ),
                               scalar(g, "descale_k", kDescaleK), scalar(g, "descale_v", kDescaleV),
                               scalar(g, "descale_s", kDescaleS), scalar(g, "scale_s", kScaleS),
                               scalar(g, "scale_o", kScaleO), attrs);
        o = outs[0];
        stats = outs[1];
        as_scalar_output(outs[2], kAmaxS);
        as_scalar_output(outs[3], kAmaxO);
      } else {
        auto outs = g.sdpa(q, k, v, attrs);
        o = outs[0];
        stats = outs[1];
      }
      as_output(o, geo, kO, geo.hq, io, in, false);
      set_stats(stats, geo, true);
    });
    build_graph(impl->bwd, geo, precision, s.handle, [&](fe::graph::Graph& g, fe::DataType_t io) {
      const Inputs in = common_inputs(g, geo);
      auto q = data_tensor(g, geo, "Q", kQ, geo.hq, io, in, false);
      auto k = data_tensor(g, geo, "K", kK, geo.hkv, io, in, true);
      auto v = data_tensor(g, geo, "V", kV, geo.hkv, io, in, true);
      auto o = data_tensor(g, geo, "O", kO, geo.hq, io, in, false);
      auto dout = data_tensor(g, geo, "dO", kDO, geo.hq, io, in, false);
      auto stats = g.tensor(fe::graph::Tensor_attributes().set_name("stats"));
      set_stats(stats, geo, false);
      std::array<TensorPtr, 3> grads;
      if (fp8) {
        auto attrs = fe::graph::SDPA_fp8_backward_attributes()
                         .set_name("sdpa_backward")
                         .set_attn_scale(p.softmax_scale)
                         .set_causal_mask(p.causal)
                         .set_padding_mask(true)
                         .set_seq_len_q(in.seq_len)
                         .set_seq_len_kv(in.seq_len);
        auto outs = g.sdpa_fp8_backward(
            q, k, v, o, dout, stats, scalar(g, "descale_q", kDescaleQ),
            scalar(g, "descale_k", kDescaleK), scalar(g, "descale_v", kDescaleV),
            scalar(g, "descale_o", kDescaleO), scalar(g, "descale_do", kDescaleDO),
            scalar(g, "descale_s", kDescaleS), scalar(g, "descale_dp", kDescaleDP),
            scalar(g, "scale_s", kScaleS), scalar(g, "scale_dq", kScaleDQ),
            scalar(g, "scale_dk", kScaleDK), scalar(g, "scale_dv", kScaleDV),
            scalar(g, "scale_dp", kScaleDP), attrs);
        grads = {outs[0], outs[1], outs[2]};
        as_scalar_output(outs[3], kAmaxDQ);
        as_scalar_output(outs[4], kAmaxDK);
        as_scalar_output(outs[5], kAmaxDV);
        as_scalar_output(outs[6], kAmaxDP);
      } else {
        auto attrs = fe::graph::SDPA_backward_attributes()
                         .set_name("sdpa_backward")
                         .set_attn_scale(p.softmax_scale)
                         .set_causal_mask(p.causal)
                         .set_padding_mask(true)
                         .set_seq_len_q(in.seq_len)
                         .set_seq_len_kv(in.seq_len);
        if (layout == CudnnLayout::kRagged)
          attrs.set_max_total_seq_len_q(geo.tokens).set_max_total_seq_len_kv(geo.tokens);
        grads = g.sdpa_backward(q, k, v, o, dout, stats, attrs);
      }
      as_output(grads[0], geo, kDQ, geo.hq, io, in, false);
      as_output(grads[1], geo, kDK, geo.hkv, io, in, true);
      as_output(grads[2], geo, kDV, geo.hkv, io, in, true);
    });
    int64_t wf = 0, wb = 0;
    check(impl->fwd.get_workspace_size(wf), "get_workspace_size");
    check(impl->bwd.get_workspace_size(wb), "get_workspace_size");
    impl->workspace = std::max(wf, wb);
  } catch (const std::exception& e) {
    *reason = e.what();
    return nullptr;
  }
  return std::unique_ptr<CudnnSdpa>(new CudnnSdpa(std::move(impl)));
}

void CudnnSdpa::forward(const SdpaBuffers& b, void* workspace) const {
  auto m = impl_->pack(b, true);
  check(impl_->fwd.execute(state().handle, m, workspace), "forward execute");
}

void CudnnSdpa::backward(const SdpaBuffers& b, void* workspace) const {
  auto m = impl_->pack(b, false);
  check(impl_->bwd.execute(state().handle, m, workspace), "backward execute");
}

}  // namespace flamia::bench
