// The CPU kernels' entry points: Python functions (pybind) for the runner's direct calls,
// and registered operators (`torch.ops.vllm_cpu.*`) for calls from compiled graphs, which
// reach them through the dispatcher without a Python frame per call.
#include <torch/extension.h>
#include <torch/library.h>

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor kv_cache,
                                     torch::Tensor block_table, torch::Tensor seq_lens,
                                     double scale, int64_t window, double soft_cap,
                                     int64_t head_begin, int64_t head_end);
bool paged_prefill_attention(torch::Tensor query, torch::Tensor kv_cache,
                             torch::Tensor block_table, torch::Tensor query_start,
                             torch::Tensor query_len, torch::Tensor seq_lens, torch::Tensor out,
                             double scale, bool causal, int64_t window, double soft_cap,
                             torch::Tensor key_end);
bool encoder_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                       const std::vector<int64_t>& starts, torch::Tensor out, double scale);
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
              torch::Tensor slot_mapping);
torch::Tensor argmax_rows(torch::Tensor logits);
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows);
torch::Tensor pack_block_codes(torch::Tensor codes, int64_t bits);
torch::Tensor quant_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m,
                         int64_t bits);
bool quant_gemv_available();
torch::Tensor gguf_mm(torch::Tensor x, torch::Tensor w, int64_t type);
torch::Tensor gguf_dequantize(torch::Tensor blocks, int64_t type);
std::tuple<torch::Tensor, int64_t> gguf_repack(torch::Tensor blocks, int64_t type);
bool gguf_mm_available();
std::string gguf_mm_form();
int64_t gguf_mm_dense_rows(int64_t type);
void set_gguf_mm_dense_rows(int64_t rows);
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor topk_weights, torch::Tensor topk_ids,
                          torch::Tensor w1, torch::Tensor w3, torch::Tensor w2,
                          int64_t w1_type, int64_t w3_type, int64_t w2_type);
bool moe_experts_available();
torch::Tensor shm_all_reduce(torch::Tensor x, torch::Tensor segment, int64_t rank,
                             int64_t world, double timeout_s);
torch::Tensor lora_delta(torch::Tensor x, torch::Tensor indices, torch::Tensor ranks,
                         torch::Tensor a, torch::Tensor b, at::IntArrayRef part_bounds);
bool lora_kernel_available();
torch::Tensor pack_int8_weight(torch::Tensor w);
torch::Tensor int8_mm(torch::Tensor x, torch::Tensor packed, int64_t n);
bool int8_mm_available();
void bind_fused_decoder(pybind11::module& m);  // the FusedDecoder class (fused_decode.cpp)

// The instruction-set extensions this build was compiled for (`-march`), in /proc/cpuinfo's
// names: what its kernels can run, which a test asks rather than the processor (a build
// for another target, VLLM_CPU_MARCH, runs the forms of that target).
std::vector<std::string> isa() {
  std::vector<std::string> flags;
#if defined(__AVX2__)
  flags.push_back("avx2");
#endif
#if defined(__FMA__)
  flags.push_back("fma");
#endif
#if defined(__F16C__)
  flags.push_back("f16c");
#endif
#if defined(__AVX512F__)
  flags.push_back("avx512f");
#endif
#if defined(__AVX512BW__)
  flags.push_back("avx512bw");
#endif
#if defined(__AVX512VL__)
  flags.push_back("avx512vl");
#endif
#if defined(__AVX512VNNI__)
  flags.push_back("avx512_vnni");
#endif
#if defined(__AVX512BF16__)
  flags.push_back("avx512_bf16");
#endif
  return flags;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention over a block-paged KV cache (CPU); a sliding window "
        "(0: none), a logit soft-cap (0: none), and the query heads [head_begin, head_end) "
        "computed (-1: to the last; the other heads' rows are zeros)",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_table"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window") = 0, py::arg("soft_cap") = 0.0,
        py::arg("head_begin") = 0, py::arg("head_end") = -1);
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Paged prefill attention of every prompt chunk of a step (CPU); false if unsupported",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_table"), py::arg("query_start"),
        py::arg("query_len"), py::arg("seq_lens"), py::arg("out"), py::arg("scale"),
        py::arg("causal"), py::arg("window") = 0, py::arg("soft_cap") = 0.0,
        py::arg("key_end") = torch::empty({0}, torch::kInt32));
  m.def("encoder_attention", &encoder_attention,
        "Bidirectional bfloat16 attention within each encoder input (CPU, AVX512-BF16); "
        "false if unsupported",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("starts"), py::arg("out"),
        py::arg("scale"));
  m.def("write_kv", &write_kv, "Stores a step's keys and values at their cache slots (CPU)");
  m.def("argmax_rows", &argmax_rows, "Row-wise argmax, as torch.argmax(dim=-1) (CPU)");
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "-inf, in place, at each logits row's tokens its packed grammar bitmask forbids (CPU)",
        py::arg("logits"), py::arg("bitmask"), py::arg("rows"));
  m.def("pack_block_codes", &pack_block_codes,
        "Block codes [N, Kp] uint8 -> quant_gemv's pair layout");
  m.def("quant_gemv_available", &quant_gemv_available,
        "Whether quant_gemv was built (AVX-512 VNNI, or AVX2 with FMA and F16C)");
  m.def("gguf_mm_available", &gguf_mm_available,
        "Whether gguf_mm was built (AVX2 with FMA and F16C)");
  m.def("gguf_repack", &gguf_repack,
        "A GGUF weight's rows in the form gguf_mm reads fastest, and that form's type id "
        "(Q5_0 -> 1006; other types as they are)");
  m.def("gguf_mm_form", &gguf_mm_form,
        "The instruction-set form gguf_mm was built in: avx512, avx2, or empty");
  m.def("gguf_mm_dense_rows", &gguf_mm_dense_rows,
        "The step size from which gguf_mm multiplies weights of a ggml type by their "
        "dequantized values (0: never)", py::arg("type"));
  m.def("set_gguf_mm_dense_rows", &set_gguf_mm_dense_rows,
        "Sets gguf_mm's dense step size for every type (0: never; -1: the defaults)",
        py::arg("rows"));
  m.def("moe_experts_available", &moe_experts_available,
        "Whether moe_experts was built (AVX2 with FMA and F16C)");
  m.def("shm_all_reduce", &shm_all_reduce,
        "Sum of the local ranks' tensors through a shared-memory segment (CPU)");
  m.def("lora_kernel_available", &lora_kernel_available,
        "Whether lora_delta was built (AVX-512)");
  m.def("pack_int8_weight", &pack_int8_weight,
        "int8 weight [N, K] -> int8_mm's tiles of 16 columns");
  m.def("int8_mm_available", &int8_mm_available, "Whether int8_mm was built (AVX2)");
  m.def("isa", &isa, "The instruction-set extensions this build was compiled for");
  bind_fused_decoder(m);
}

TORCH_LIBRARY(vllm_cpu, m) {
  m.def("quant_gemv(Tensor x, Tensor codes, Tensor d, Tensor m, int bits) -> Tensor");
  m.def("gguf_mm(Tensor x, Tensor w, int type) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int type) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor w1, Tensor w3, "
        "Tensor w2, int w1_type, int w3_type, int w2_type) -> Tensor");
  m.def("lora_delta(Tensor x, Tensor indices, Tensor ranks, Tensor a, Tensor b, "
        "int[] part_bounds) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_cpu, CPU, m) {
  m.impl("quant_gemv", &quant_gemv);
  m.impl("gguf_mm", &gguf_mm);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("moe_experts", &moe_experts);
  m.impl("lora_delta", &lora_delta);
  m.impl("int8_mm", &int8_mm);
}
