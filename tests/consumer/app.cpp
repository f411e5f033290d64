// Sums one per rank through the installed library.
#include <fsdp/fsdp.h>

#include <iostream>

int main() {
  auto pg = fsdp::init_process_group();
  at::Tensor t = at::ones({1});
  pg->all_reduce(t).wait();
  std::cout << "consumer rank " << pg->rank() << " counted " << t.item<float>() << std::endl;
  return t.item<float>() == pg->size() ? 0 : 1;
}
