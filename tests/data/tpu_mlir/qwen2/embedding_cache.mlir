module @"embedding_cache" attributes {module.chip = "ALL", module.platform = "LLM", module.state = "TOP_F32", module.top_run_mode = "STATIC", module.weight_file = "embedding_cache_top_weights.npz"} {
  func.func @main(%arg0: tensor<1x1xsi32> loc(unknown)) -> tensor<1x1x64xf32> {
    %0 = "top.None"() : () -> none loc(unknown)
    %1 = "top.Input"(%arg0) : (tensor<1x1xsi32>) -> tensor<1x1xf32> loc(fused["input_ids"])
    %2 = "top.Weight"() : () -> tensor<256x64xf32> loc(fused["model.embed_tokens.weight"])
    %3 = "top.Gather"(%2, %1) {axis = 0 : si32} : (tensor<256x64xf32>, tensor<1x1xf32>) -> tensor<1x1x64xf32> loc(fused["input_states"])
    return %3 : tensor<1x1x64xf32> loc(unknown)
  } loc(unknown)
} loc(unknown)
