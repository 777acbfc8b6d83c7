"""The bundled target environment: retail customer support.

Our stand-in for a production deployment, in the spirit of tau2-bench's retail domain
with our own data and code. Every seed builds a small world (users, orders, products)
and one ticket that states everything the user knows. A ticket's reference action
sequence follows from how it was built; grading replays it on a fresh copy of the world
and compares the final order states (a hash, as tau2-bench does), then checks the facts
the user had to be told.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

from trace_plugin.environments.base import RewardBreakdown, Task, ToolCall, argument_problem

TRAIN_SEEDS = range(0, 200)
TEST_SEEDS = range(10_000, 10_100)

POLICY = """You are a retail support agent. Policy:
- Identify the user with find_user before changing anything.
- Cancel or re-address only pending orders; cancel reasons: "no longer needed", "ordered by mistake".
- Return or exchange only items of delivered orders; exchange to an available variant of the same product.
- Copy ids from tool results. Refuse what the policy forbids and say why.
End with one short message telling the user the outcome."""


def _tool(name: str, *params: str, optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """A compact OpenAI tool schema: names carry the meaning, every prompt token costs training time."""
    properties = {p: {"type": "array" if p.endswith("_ids") else "string"} for p in (*params, *optional)}
    schema = {"type": "object", "properties": properties, "required": list(params)}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = [
    _tool("find_user", optional=("email", "first_name", "last_name", "zip")),
    _tool("get_user", "user_id"),
    _tool("get_order", "order_id"),
    _tool("get_product", "product_id"),
    _tool("cancel_order", "order_id", "reason"),
    _tool("modify_address", "order_id", "address1", "city", "zip"),
    _tool("return_items", "order_id", "item_ids"),
    _tool("exchange_items", "order_id", "item_ids", "new_item_ids"),
    _tool("transfer_to_human", "summary"),
]
_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WRITE_TOOLS = {"cancel_order", "modify_address", "return_items", "exchange_items"}
CANCEL_REASONS = ("no longer needed", "ordered by mistake")

_FIRST = ["Ava", "Liam", "Mia", "Noah", "Zoe", "Omar", "Ines", "Kenji", "Lena", "Raj", "Sofia", "Yuki"]
_LAST = ["Lopez", "Kim", "Novak", "Okafor", "Silva", "Chen", "Weber", "Haddad", "Rossi", "Patel"]
_CITIES = [
    ("Austin", "78701"),
    ("Denver", "80202"),
    ("Boston", "02108"),
    ("Seattle", "98101"),
    ("Miami", "33101"),
]
_STREETS = ["Oak St", "Pine Ave", "Maple Rd", "Cedar Ln", "Elm Dr", "Birch Way"]
_CATALOG = {
    "T-Shirt": {"color": ["red", "blue", "black"], "size": ["S", "M", "L"]},
    "Water Bottle": {"color": ["green", "white"], "capacity": ["500ml", "1l"]},
    "Backpack": {"color": ["grey", "navy"], "size": ["small", "large"]},
    "Desk Lamp": {"color": ["white", "black"], "brightness": ["low", "high"]},
    "Headphones": {"color": ["black", "silver"], "type": ["wired", "wireless"]},
    "Running Shoes": {"color": ["red", "white"], "size": ["8", "9", "10"]},
}
KINDS = (
    "lookup",
    "cancel",
    "refuse_cancel",
    "modify_address",
    "return_item",
    "exchange_item",
    "return_multi",
    "refuse_return",
)


@dataclass
class World:
    users: dict[str, dict[str, Any]] = field(default_factory=dict)
    orders: dict[str, dict[str, Any]] = field(default_factory=dict)
    products: dict[str, dict[str, Any]] = field(default_factory=dict)

    def digest(self) -> str:
        """The graded part of the state: every order as it stands."""
        return hashlib.sha256(json.dumps(self.orders, sort_keys=True).encode()).hexdigest()


def _options_text(options: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in options.items())


def build_world(rng: random.Random) -> World:
    world = World()
    for name, dims in _CATALOG.items():
        product_id = str(rng.randrange(1000, 9999))
        combos = {tuple(rng.choice(values) for values in dims.values()) for _ in range(8)}
        variants = {}
        for combo in sorted(combos)[:3]:
            variants[str(rng.randrange(100000, 999999))] = {
                "options": dict(zip(dims, combo, strict=True)),
                "price": round(rng.uniform(10, 120), 2),
                "available": rng.random() < 0.8,
            }
        world.products[product_id] = {"name": name, "variants": variants}
    for first, last in zip(rng.sample(_FIRST, 3), rng.sample(_LAST, 3), strict=True):
        city, zip_code = rng.choice(_CITIES)
        user_id = f"{first.lower()}_{last.lower()}_{rng.randrange(1000, 9999)}"
        address = {
            "address1": f"{rng.randrange(1, 999)} {rng.choice(_STREETS)}",
            "city": city,
            "zip": zip_code,
        }
        world.users[user_id] = {
            "first_name": first,
            "last_name": last,
            "email": f"{first.lower()}.{last.lower()}{rng.randrange(10, 99)}@example.com",
            "address": address,
            "orders": [],
        }
        for _ in range(2):
            order_id = f"#W{rng.randrange(1000000, 9999999)}"
            items = []
            for product_id in rng.sample(sorted(world.products), rng.randint(1, 3)):
                item_id, variant = rng.choice(sorted(world.products[product_id]["variants"].items()))
                product = world.products[product_id]["name"]
                items.append(
                    {
                        "item_id": item_id,
                        "product_id": product_id,
                        "name": product,
                        "options": variant["options"],
                        "price": variant["price"],
                    }
                )
            world.orders[order_id] = {
                "user_id": user_id,
                "status": rng.choice(["pending", "processed", "delivered", "cancelled"]),
                "items": items,
                "address": dict(address),
            }
            world.users[user_id]["orders"].append(order_id)
    return world


class RetailEnv:
    """One retail-support episode at a time; instances share nothing."""

    tools = TOOLS
    system_prompt = POLICY

    def __init__(self) -> None:
        self.world = World()
        self.task: Task | None = None
        self._initial = World()
        self._identified: str | None = None
        self._done = False
        self.calls: list[ToolCall] = []

    # -- the protocol -------------------------------------------------------------------

    def reset(self, seed: int) -> Task:
        rng = random.Random(seed)
        self.world = build_world(rng)
        self.task = _make_task(seed, self.world, rng)
        self._initial = copy.deepcopy(self.world)
        self._identified, self._done, self.calls = None, False, []
        return self.task

    def opening(self, seed: int) -> list[dict[str, Any]]:
        """An agent's first messages on the task of ``seed``: the policy and the ticket."""
        return [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": self.reset(seed).prompt},
        ]

    @property
    def done(self) -> bool:
        return self._done

    def step(self, call: ToolCall) -> str:
        self.calls.append(call)
        schema = _SCHEMAS.get(call.name)
        if schema is None or self.task is None:
            return _error(f"unknown tool {call.name!r}" if self.task else "call reset() first")
        problem = argument_problem(schema, call.arguments)
        if problem:
            return _error(f"bad arguments for {call.name}: {problem}")
        try:
            result = getattr(self, f"_tool_{call.name}")(**call.arguments)
        except ValueError as exc:
            return _error(str(exc))
        return json.dumps(result)

    def reward(self, answer: str = "") -> RewardBreakdown:
        if self.task is None:
            return RewardBreakdown(0.0)
        expected = copy.deepcopy(self._initial)
        replay = RetailEnv()
        replay.world, replay.task = expected, self.task
        for call in self.task.metadata["reference"]:
            replay.step(ToolCall(call["name"], call["arguments"]))
        state_ok = float(expected.digest() == self.world.digest())
        facts = self.task.metadata["facts"]
        told = sum(1 for fact in facts if fact.lower() in answer.lower()) / len(facts) if facts else 1.0
        return RewardBreakdown(float(state_ok == 1.0 and told == 1.0), {"state": state_ok, "facts": told})

    # -- tools -----------------------------------------------------------------------------

    def _tool_find_user(
        self, email: str = "", first_name: str = "", last_name: str = "", zip: str = ""
    ) -> str:
        if email:
            key, wanted = ("email",), (email.strip().lower(),)
        elif first_name and last_name and zip:
            key, wanted = (
                ("first_name", "last_name", "zip"),
                (first_name.strip().lower(), last_name.strip().lower(), zip.strip()),
            )
        else:
            raise ValueError("give an email, or first_name, last_name and zip")
        for user_id, user in self.world.users.items():
            fields = {**user, "zip": user["address"]["zip"]}
            if tuple(str(fields[k]).lower() for k in key) == wanted:
                self._identified = user_id
                return user_id
        raise ValueError("no such user")

    def _tool_get_user(self, user_id: str) -> dict[str, Any]:
        user = self.world.users.get(user_id)
        if user is None:
            raise ValueError(f"user {user_id} not found")
        return {k: user[k] for k in ("first_name", "last_name", "email", "address", "orders")}

    def _tool_get_order(self, order_id: str) -> dict[str, Any]:
        return {"order_id": order_id, **self._order(order_id)}

    def _tool_get_product(self, product_id: str) -> dict[str, Any]:
        product = self.world.products.get(product_id)
        if product is None:
            raise ValueError(f"product {product_id} not found")
        return {"product_id": product_id, **product}

    def _tool_cancel_order(self, order_id: str, reason: str) -> dict[str, Any]:
        order = self._writable(order_id, "pending")
        if reason not in CANCEL_REASONS:
            raise ValueError(f"reason must be one of {list(CANCEL_REASONS)}")
        order.update(status="cancelled", cancel_reason=reason)
        return {"order_id": order_id, "status": "cancelled"}

    def _tool_modify_address(self, order_id: str, address1: str, city: str, zip: str) -> dict[str, Any]:
        order = self._writable(order_id, "pending")
        order["address"] = {"address1": address1.strip(), "city": city.strip(), "zip": zip.strip()}
        return {"order_id": order_id, "address": order["address"]}

    def _tool_return_items(self, order_id: str, item_ids: list[str]) -> dict[str, Any]:
        order = self._writable(order_id, "delivered")
        self._check_items(order, item_ids)
        order.update(status="return requested", returned_items=sorted(item_ids))
        return {"order_id": order_id, "status": "return requested"}

    def _tool_exchange_items(
        self, order_id: str, item_ids: list[str], new_item_ids: list[str]
    ) -> dict[str, Any]:
        order = self._writable(order_id, "delivered")
        self._check_items(order, item_ids)
        if len(item_ids) != len(new_item_ids):
            raise ValueError("item_ids and new_item_ids must have the same length")
        by_id = {i["item_id"]: i for i in order["items"]}
        for old, new in zip(item_ids, new_item_ids, strict=True):
            variants = self.world.products[by_id[old]["product_id"]]["variants"]
            if new not in variants or new == old:
                raise ValueError(f"{new} is not another variant of the same product as {old}")
            if not variants[new]["available"]:
                raise ValueError(f"item {new} is not available")
        order.update(
            status="exchange requested", exchanged_items=sorted(zip(item_ids, new_item_ids, strict=True))
        )
        return {"order_id": order_id, "status": "exchange requested"}

    def _tool_transfer_to_human(self, summary: str) -> str:
        self._done = True
        return "transferred"

    # -- helpers -----------------------------------------------------------------------------

    def _order(self, order_id: str) -> dict[str, Any]:
        order = self.world.orders.get(str(order_id).strip())
        if order is None:
            raise ValueError(f"order {order_id} not found")
        return order

    def _writable(self, order_id: str, status: str) -> dict[str, Any]:
        order = self._order(order_id)
        if self._identified is None:
            raise ValueError("identify the user before changing an order")
        if order["user_id"] != self._identified:
            raise ValueError("that order belongs to another user")
        if order["status"] != status:
            raise ValueError(f"order is {order['status']}; this needs a {status} order")
        return order

    @staticmethod
    def _check_items(order: dict[str, Any], item_ids: list[str]) -> None:
        if not isinstance(item_ids, list) or not item_ids:
            raise ValueError("item_ids must be a non-empty list")
        known = {i["item_id"] for i in order["items"]}
        unknown = [i for i in item_ids if i not in known]
        if unknown or len(set(item_ids)) != len(item_ids):
            raise ValueError(f"items not in this order: {unknown or 'duplicates'}")


def _error(message: str) -> str:
    return json.dumps({"error": message})


# -- tickets ---------------------------------------------------------------------------------


def _make_task(seed: int, world: World, rng: random.Random) -> Task:
    kind = KINDS[seed % len(KINDS)]
    needs = {
        "lookup": None,
        "cancel": "pending",
        "refuse_cancel": "delivered",
        "modify_address": "pending",
        "return_item": "delivered",
        "exchange_item": "delivered",
        "return_multi": "delivered",
        "refuse_return": "pending",
    }[kind]
    order_id = rng.choice(sorted(world.orders))
    order, user_id = world.orders[order_id], world.orders[order_id]["user_id"]
    user = world.users[user_id]
    if needs:
        order["status"] = needs
    if kind == "return_multi" and len(order["items"]) < 2:  # make room for two items
        extra = next(p for p in sorted(world.products) if p not in {i["product_id"] for i in order["items"]})
        item_id, variant = sorted(world.products[extra]["variants"].items())[0]
        order["items"].append(
            {
                "item_id": item_id,
                "product_id": extra,
                "name": world.products[extra]["name"],
                "options": variant["options"],
                "price": variant["price"],
            }
        )
    if rng.random() < 0.5:
        ident = f"My email is {user['email']}."
        find = {"name": "find_user", "arguments": {"email": user["email"]}}
    else:
        ident = f"I'm {user['first_name']} {user['last_name']}, zip {user['address']['zip']}."
        find = {
            "name": "find_user",
            "arguments": {
                "first_name": user["first_name"],
                "last_name": user["last_name"],
                "zip": user["address"]["zip"],
            },
        }
    look = {"name": "get_order", "arguments": {"order_id": order_id}}
    reference, facts = [find, look], []
    item = order["items"][0]
    if kind == "lookup":
        prompt = f"What is the status of my order {order_id}? {ident}"
        facts = [order["status"]]
    elif kind in ("cancel", "refuse_cancel"):
        reason = rng.choice(CANCEL_REASONS)
        prompt = f"Please cancel my order {order_id}, reason: {reason}. {ident}"
        if kind == "cancel":
            reference.append({"name": "cancel_order", "arguments": {"order_id": order_id, "reason": reason}})
    elif kind == "modify_address":
        city, zip_code = rng.choice(_CITIES)
        address1 = f"{rng.randrange(1, 999)} {rng.choice(_STREETS)}"
        prompt = f"Please ship order {order_id} to {address1}, {city} {zip_code} instead. {ident}"
        reference.append(
            {
                "name": "modify_address",
                "arguments": {"order_id": order_id, "address1": address1, "city": city, "zip": zip_code},
            }
        )
    elif kind in ("return_item", "refuse_return"):
        described = f"{item['name']} ({_options_text(item['options'])})"
        prompt = f"I want to return the {described} from order {order_id}. {ident}"
        if kind == "return_item":
            reference.append(
                {"name": "return_items", "arguments": {"order_id": order_id, "item_ids": [item["item_id"]]}}
            )
    elif kind == "return_multi":
        first, second = order["items"][:2]
        prompt = f"Please return the {first['name']} and the {second['name']} from order {order_id}. {ident}"
        reference.append(
            {
                "name": "return_items",
                "arguments": {"order_id": order_id, "item_ids": [first["item_id"], second["item_id"]]},
            }
        )
    else:  # exchange_item
        variants = world.products[item["product_id"]]["variants"]
        target = next((i for i, v in sorted(variants.items()) if i != item["item_id"]), None)
        if target is None:  # a single-variant product: add a second one
            target = str(int(item["item_id"]) + 1)
            variants[target] = {"options": dict(item["options"]), "price": item["price"], "available": True}
        variants[target]["available"] = True
        wanted = _options_text(variants[target]["options"])
        prompt = (
            f"I'd like to exchange the {item['name']} ({_options_text(item['options'])}) in order {order_id} "
            f"for the one with {wanted}. {ident}"
        )
        reference += [
            {"name": "get_product", "arguments": {"product_id": item["product_id"]}},
            {
                "name": "exchange_items",
                "arguments": {"order_id": order_id, "item_ids": [item["item_id"]], "new_item_ids": [target]},
            },
        ]
    metadata = {"reference": reference, "facts": facts, "order_id": order_id, "user_id": user_id}
    return Task(seed, prompt, kind, metadata)
