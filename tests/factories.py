"""factory-boy factories for the console's models."""

from __future__ import annotations

import factory
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group

from nodes.models import Credential, CredentialKind, Device, DeviceKind, Node, Transport

PASSWORD = "correct horse battery staple 42"


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.test")
    password = factory.PostGenerationMethodCall("set_password", PASSWORD)

    @factory.post_generation
    def role(self, create, extracted, **kwargs):
        if extracted:
            # get_or_create: transactional tests flush the groups that the roles migration made.
            self.groups.add(Group.objects.get_or_create(name=extracted)[0])
        self.save()


class CredentialFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Credential
        skip_postgeneration_save = True

    name = factory.Sequence(lambda n: f"cred-{n}")
    kind = CredentialKind.PASSWORD

    @factory.post_generation
    def secret(self, create, extracted, **kwargs):
        self.set_secret(extracted or "not-a-real-password", kwargs.get("passphrase", ""))
        if create:
            self.save()


class NodeFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Node

    name = factory.Sequence(lambda n: f"node-{n}")
    address = factory.Sequence(lambda n: f"10.77.{n // 250}.{n % 250 + 2}")
    transport = Transport.SSH
    ssh_user = "root"


class DeviceFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Device

    node = factory.SubFactory(NodeFactory)
    name = "CPU"
    kind = DeviceKind.CPU
    total_bytes = 16 * 1024**3
    free_bytes = 12 * 1024**3
    bandwidth_gbs = 40.0
