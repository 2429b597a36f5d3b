// The engine library; its sources land in this folder.
namespace recur {}
