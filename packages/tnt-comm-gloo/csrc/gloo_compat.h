// The two forms of Gloo's rendezvous API this module builds against. Gloo took the store
// by reference (`Store&`) in PrefixStore and Context::connectFullMesh up to its 2022
// snapshots (Debian 12's libgloo-dev, the editable/dev build) and takes a
// `std::shared_ptr<Store>` since (Debian's 2025 snapshot, which the wheels bundle). The
// helpers pick the form the headers declare at compile time; the rest of the module holds
// the store in a shared_ptr either way.
#pragma once

#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>

namespace tnt_gloo {

using StorePtr = std::shared_ptr<gloo::rendezvous::Store>;

// PrefixStore(prefix, base). The reference form keeps `base` alive as long as the result.
template <typename Prefix = gloo::rendezvous::PrefixStore>
StorePtr make_prefix_store(const std::string& prefix, StorePtr base) {
  if constexpr (std::is_constructible_v<Prefix, const std::string&, StorePtr>) {
    return std::make_shared<Prefix>(prefix, std::move(base));
  } else {
    gloo::rendezvous::Store* store = new Prefix(prefix, *base);
    return StorePtr(store, [base](gloo::rendezvous::Store* s) { delete s; });
  }
}

// context.connectFullMesh(store, device): the shared_ptr form where the headers have it
// (the int overload is the better match), else the reference form.
template <typename Context, typename Device>
auto connect_full_mesh(Context& context, const StorePtr& store, Device& device, int)
    -> decltype(context.connectFullMesh(store, device), void()) {
  context.connectFullMesh(store, device);
}

template <typename Context, typename Device>
void connect_full_mesh(Context& context, const StorePtr& store, Device& device, long) {
  context.connectFullMesh(*store, device);
}

template <typename Context, typename Device>
void connect_full_mesh(Context& context, const StorePtr& store, Device& device) {
  connect_full_mesh(context, store, device, 0);
}

}  // namespace tnt_gloo
