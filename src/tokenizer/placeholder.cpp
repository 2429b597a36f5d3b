// The tokenizer library; its sources land in this folder.
namespace recur {}
